"""The training's progress, with one owner: how far the run is, and nothing else writes it.

``Progress`` holds the optimizer steps taken, the data position that follows from them, the tokens and
samples trained (all drafters' sums: every drafter counts the same), the steps left out for a non-finite
loss or gradient, and the schedule's clock (under --max-minutes, the drafters' agreed share of the time
spent; the learning-rate schedule reads it, ``optim.Schedule``). It changes in two places only, both the
drafter worker's: a step queued (``step_taken``) and a step's record read one step late (``count``).
Everyone else reads it: the monitor, the schedule, the checkpoint manager, which saves and loads it with
``state_dict()``/``load_state_dict()`` (the checkpoint's trainer state: ``checkpoint.state.TrainerState``).
The batches in flight at a checkpoint are the transport's (``transport``; a resume recomputes them).
"""

from __future__ import annotations

from typing import Any


class Progress:
    """Where the training stands (see the module docstring)."""

    def __init__(self, step: int = 0, batches_per_step: int = 1):
        self.step = step
        """Optimizer steps taken: queued, since the host runs one step ahead (the record of the last one is read
        at the next step, or at the end)."""
        self.batches_per_step = batches_per_step
        self.tokens = 0
        self.samples = 0
        self.skipped_steps = 0
        """Steps left out by the update (a non-finite loss or gradient)."""
        self.clock = 0.0
        """The share of the time limit spent, 0 to 1, as the drafters agreed on it (0: no time limit)."""

    @property
    def next_seq(self) -> int:
        """The first batch of the next step (where a resume starts)."""
        return self.step * self.batches_per_step

    def step_taken(self) -> None:
        """An optimizer step was queued."""
        self.step += 1

    def count(self, record) -> None:
        """A step's record, read (``drafter_worker.StepRecord``): what it trained, whether it was left out, and
        the clock the drafters agreed on (the schedule never goes back, and stops at the limit)."""
        self.tokens += record.tokens
        self.samples += record.samples
        if not record.finite:
            self.skipped_steps += 1
        self.clock = max(self.clock, min(1.0, record.clock))

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state: step, data position, batches per step, counters."""
        return {"step": self.step, "next_seq": self.next_seq, "batches_per_step": self.batches_per_step,
                "counters": {"tokens": self.tokens, "samples": self.samples, "skipped_steps": self.skipped_steps,
                             "clock": self.clock}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's trainer state (its batches per step stays the run's: the spec resolved it from the
        checkpoint already)."""
        counters = state.get("counters", {})
        self.step = int(state["step"])
        self.tokens = int(counters.get("tokens", 0))
        self.samples = int(counters.get("samples", 0))
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self.clock = float(counters.get("clock", 0.0))
