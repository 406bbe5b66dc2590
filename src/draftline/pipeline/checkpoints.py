"""The run's checkpoints: when to save, what a training checkpoint holds, and how a resume continues.

When: every ``checkpoint.every_steps`` steps, and when the first drafter's clock says
``checkpoint.every_minutes`` have passed since its last save. The clock is one rank's, so its verdict
travels in the step's record (``StepRecord.save``, summed over the drafters like the stop flag): every
drafter saves at the same step, which a sharded checkpoint needs. At the end of a run, on a stop, and
(one drafter) after a failure the loop or the failure handler saves too.

A resume continues exactly: the same batches in the same order from the checkpoint's step, with the
checkpoint's batches per optimizer step, on any number of drafters (each takes its share of a step;
``roles.drafter_share``), so a run stopped on two drafters and resumed on one ends with the weights
of the run that never stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftline.checkpoint.state import TrainerState, load_checkpoint, save_checkpoint
from draftline.errors import DraftlineError
from draftline.pipeline.drafter_worker import DrafterWorker, StepRecord
from draftline.distributed.shard import DrafterGroup
from draftline.pipeline.spec import RunSpec


class CheckpointPolicy:
    """When the run saves (see the module docstring)."""

    def __init__(self, every_steps: int, every_minutes: float, total_steps: int):
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.total_steps = total_steps
        self.last_save = time.time()

    def clock_due(self) -> bool:
        """The first drafter's clock: time for a save (its flag rides on the next step's record)."""
        return bool(self.every_minutes) and time.time() - self.last_save > self.every_minutes * 60

    def due(self, record: StepRecord) -> bool:
        """Whether to save after ``record``'s step (the end of the run saves anyway)."""
        if record.step >= self.total_steps:
            return False
        return record.save or bool(self.every_steps and record.step % self.every_steps == 0)

    def saved(self) -> None:
        self.last_save = time.time()


class Checkpointer:
    """Saves the drafter worker's current step when the policy says so; every drafter holds one."""

    def __init__(self, spec: RunSpec, worker: DrafterWorker, group: DrafterGroup, *, counters=lambda: {},
                 in_flight=lambda: []):
        c = spec.config.checkpoint
        self.spec = spec
        self.worker = worker
        self.group = group
        self.policy = CheckpointPolicy(c.every_steps, c.every_minutes, spec.total_steps)
        self.counters = counters  # what the monitor counted so far (tokens, samples)
        self.in_flight = in_flight  # batches claimed and not trained (recomputed after a resume)
        self.last: Path | None = None

    def clock_due(self) -> bool:
        return self.group.is_first and self.policy.clock_due()

    def due(self, record: StepRecord) -> bool:
        return self.policy.due(record)

    def save(self, wait: bool = False) -> Path:
        """Checkpoint the worker's current step (every drafter calls this at the same step)."""
        worker, spec = self.worker, self.spec
        state = TrainerState(step=worker.step, next_seq=worker.step * spec.batches_per_step,
                             in_flight=list(self.in_flight()),
                             counters={**self.counters(), "skipped_steps": worker.counters.skipped_steps},
                             config=spec.config.to_dict(), batches_per_step=spec.batches_per_step)
        self.last = save_checkpoint(spec.run_dir, drafter=worker.drafter, optimizer=worker.optimizer,
                                    scheduler=worker.scheduler, state=state, keep=spec.config.checkpoint.keep,
                                    group=self.group, wait=wait)
        self.policy.saved()
        return self.last


def resume(spec: RunSpec, worker: DrafterWorker, group: DrafterGroup) -> dict:
    """Load ``spec.checkpoint`` into the worker's drafter, optimizer and schedule; returns its counters."""
    state = load_checkpoint(spec.checkpoint, drafter=worker.drafter, optimizer=worker.optimizer,
                            scheduler=worker.scheduler, group=group, verify=False)
    if state.step != spec.start_step or state.next_seq != spec.start_seq:
        raise DraftlineError(f"{spec.checkpoint}: holds step {state.step} (next batch {state.next_seq}), the run "
                             f"expected step {spec.start_step} (next batch {spec.start_seq})")
    return state.counters
