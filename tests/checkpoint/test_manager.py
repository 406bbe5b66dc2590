"""The checkpoint manager: it saves the objects it is handed, by their state_dict(), on the policy's cadence,
and a resume loads them back; a checkpoint written when the schedule held the time limit's clock resumes
with that clock."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftline.checkpoint.manager import CheckpointManager, CheckpointPolicy, resume
from draftline.checkpoint.state import TrainerState, save_checkpoint
from draftline.checkpoint.writer import wait_for_checkpoint
from draftline.config import OptimConfig
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.pipeline.optim import build_optimizer, build_scheduler
from draftline.pipeline.progress import Progress


class _Transport:
    def state_dict(self):
        return {"in_flight": [12, 13]}

    def load_state_dict(self, state):
        raise AssertionError("a resume recomputes the batches in flight")


def _run(qwen3_target, batches_per_step=2):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float()
    optimizer = build_optimizer(drafter, OptimConfig())
    progress = Progress(0, batches_per_step)
    scheduler = build_scheduler(optimizer, OptimConfig(), 10, progress)
    return drafter, optimizer, scheduler, progress


def _step(drafter, optimizer, scheduler, progress, *, tokens, finite=True, clock=0.0):
    sum(p.float().pow(2).sum() for p in drafter.parameters()).backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    progress.step_taken()
    progress.count(SimpleNamespace(tokens=tokens, samples=1, finite=finite, clock=clock))


def test_the_states_handed_over_are_saved_and_a_resume_loads_them(qwen3_target, tmp_path):
    drafter, optimizer, scheduler, progress = _run(qwen3_target)
    for tokens, finite in ((100, True), (50, False), (70, True)):
        _step(drafter, optimizer, scheduler, progress, tokens=tokens, finite=finite, clock=0.25)
    manager = CheckpointManager(tmp_path, drafter=drafter, optimizer=optimizer, keep=2, config={"seed": 1},
                                states={"progress": progress, "scheduler": scheduler, "transport": _Transport()},
                                policy=CheckpointPolicy(every_steps=3, every_minutes=0, total_steps=10), group=None)
    assert manager.due(3, False) and not manager.due(4, False) and manager.due(4, True) and not manager.due(10, True)
    path = manager.save(wait=True)
    trainer = json.loads((path / "trainer.json").read_text())  # readable without torch, as setup reads it
    assert (trainer["step"], trainer["next_seq"], trainer["batches_per_step"], trainer["in_flight"]) == (3, 6, 2, [12, 13])
    assert trainer["counters"] == {"tokens": 220, "samples": 3, "skipped_steps": 1, "clock": 0.25}

    again, optimizer2, scheduler2, progress2 = _run(qwen3_target)
    resume(path, drafter=again, optimizer=optimizer2, states={"progress": progress2, "scheduler": scheduler2},
           group=None, step=3, next_seq=6)
    assert progress2.state_dict() == progress.state_dict()
    assert scheduler2.last_epoch == 3 and scheduler2.get_last_lr() == scheduler.get_last_lr()
    for (name, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(DraftlineError, match="holds step 3 .* expected step 4"):
        resume(path, drafter=again, optimizer=optimizer2, states={"progress": progress2, "scheduler": scheduler2},
               group=None, step=4, next_seq=8)


def test_a_checkpoint_whose_schedule_held_the_clock_resumes_with_it(qwen3_target, tmp_path):
    """What the code before the progress owned the clock wrote: the clock in the schedule's state, counters
    without it."""
    drafter, optimizer, scheduler, _ = _run(qwen3_target)
    old_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    old_schedule.clock = 0.6  # a LambdaLR saves its attributes: as the schedule of that code did
    state = TrainerState(step=4, next_seq=8, in_flight=[], counters={"tokens": 9, "samples": 2, "skipped_steps": 0},
                         config={}, batches_per_step=2)
    path = save_checkpoint(tmp_path, drafter=drafter, optimizer=optimizer, scheduler=old_schedule, state=state,
                           keep=1, wait=True)
    again, optimizer2, scheduler2, progress2 = _run(qwen3_target)
    resume(path, drafter=again, optimizer=optimizer2, states={"progress": progress2, "scheduler": scheduler2},
           group=None, step=4, next_seq=8)
    assert (progress2.step, progress2.tokens, progress2.clock, scheduler2.clock) == (4, 9, 0.6, 0.6)
    wait_for_checkpoint()
