"""The run's checkpoints: when to save, and the manager that saves and loads the run's stateful objects.

When: every ``checkpoint.every_steps`` steps, and when the first drafter's clock says
``checkpoint.every_minutes`` have passed since its last save. The clock is one rank's, so its verdict
travels in the step's record (``StepRecord.save``, summed over the drafters like the stop flag): every
drafter saves at the same step, which a sharded checkpoint needs. At the end of a run, on a stop, and
(one drafter) after a failure the loop or the failure handler saves too.

What: the drafter and its optimizer (each rank its shards, ``state``), and the run's objects that have
``state_dict()``/``load_state_dict()``, handed over by name (``states``):

- ``progress``: the step, the data position and the counters (``pipeline.progress.Progress``); its state is
  the checkpoint's trainer state (``state.TrainerState``, readable without torch in ``trainer.json``);
- ``scheduler``: the learning-rate schedule;
- ``transport`` (saving only): the batches in flight, kept for the record (a resume recomputes them).

Nothing here reaches into another object: what a checkpoint holds is what these objects say they hold.
The drafters' group is passed in (``distributed.shard.DrafterGroup``: who writes what, and the barriers).

A resume continues exactly: the same batches in the same order from the checkpoint's step, with the
checkpoint's batches per optimizer step, on any number of drafters (each takes its share of a step;
``roles.drafter_share``), so a run stopped on two drafters and resumed on one ends with the weights
of the run that never stopped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from draftline.checkpoint.state import TrainerState, load_checkpoint, save_checkpoint
from draftline.errors import DraftlineError

PROGRESS, SCHEDULER, TRANSPORT = "progress", "scheduler", "transport"
"""The names of the states a training checkpoint holds (see the module docstring)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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

    def due(self, step: int, requested: bool) -> bool:
        """Whether to save after ``step`` (``requested``: the step's record carries the clock's save flag; the
        end of the run saves anyway)."""
        if step >= self.total_steps:
            return False
        return requested or bool(self.every_steps and step % self.every_steps == 0)

    def saved(self) -> None:
        self.last_save = time.time()


class CheckpointManager:
    """Saves the run's checkpoints when the policy says so; every drafter holds one and saves at the same step.

    ``states``: ``progress`` and ``scheduler`` (and ``transport``, for the batches in flight); ``config``: the
    resolved config, kept in the checkpoint; ``group``: the drafters' group."""

    def __init__(self, run_dir: str | Path, *, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 states: Mapping[str, Stateful], policy: CheckpointPolicy, keep: int, config: dict[str, Any], group):
        self.run_dir = Path(run_dir)
        self.drafter = drafter
        self.optimizer = optimizer
        self.states = dict(states)
        self.policy = policy
        self.keep = keep
        self.config = config
        self.group = group
        self.last: Path | None = None

    def clock_due(self) -> bool:
        return self.group.is_first and self.policy.clock_due()

    def due(self, step: int, requested: bool) -> bool:
        return self.policy.due(step, requested)

    def save(self, wait: bool = False) -> Path:
        """Checkpoint the states as they are now (every drafter calls this at the same step)."""
        trainer = self.states[PROGRESS].state_dict()
        in_flight = self.states[TRANSPORT].state_dict()["in_flight"] if TRANSPORT in self.states else []
        state = TrainerState(step=trainer["step"], next_seq=trainer["next_seq"], in_flight=list(in_flight),
                             counters=dict(trainer["counters"]), config=self.config,
                             batches_per_step=trainer["batches_per_step"])
        self.last = save_checkpoint(self.run_dir, drafter=self.drafter, optimizer=self.optimizer,
                                    scheduler=self.states[SCHEDULER], state=state, keep=self.keep, group=self.group,
                                    wait=wait)
        self.policy.saved()
        return self.last


def resume(path: str | Path, *, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer,
           states: Mapping[str, Stateful], group, step: int, next_seq: int) -> None:
    """Load checkpoint ``path`` into the drafter, its optimizer and ``states`` (``progress``, ``scheduler``),
    refusing one that does not hold ``step`` (next batch ``next_seq``), which the run resolved from it."""
    state = load_checkpoint(path, drafter=drafter, optimizer=optimizer, scheduler=states[SCHEDULER], group=group,
                            verify=False)
    if state.step != step or state.next_seq != next_seq:
        raise DraftlineError(f"{path}: holds step {state.step} (next batch {state.next_seq}), the run "
                             f"expected step {step} (next batch {next_seq})")
    states[PROGRESS].load_state_dict(state.summary())
