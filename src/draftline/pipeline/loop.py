"""The drafter's training loop, top to bottom.

    for each optimizer step from the start step:
        batches -> features  this drafter's share of the step, handed over by the targets (``receiver``)
        objective            forward and backward of every pass (``DrafterWorker.accumulate``)
        record               the step before's, read now (one step late: the GPU still works on this one);
                             its monitor line, checkpoint and evaluation; a stop agreed there (a signal, or
                             the time limit) ends the loop before this step is taken (a resume trains its
                             batches again)
        step                 the metrics all-reduced, the gradients clipped, AdamW: queued, not waited for
    the last step's record, the same way

Under a time limit (--max-minutes, ``TimeLimit``) every step also carries how much of the time is spent:
the drafters agree on it in the step's record and the learning-rate schedule follows it
(``optim.Schedule``), so a run that the clock ends is annealed like one that ran all its steps.

Every drafter runs this loop in step: the record's stop, save and time flags are summed over the drafters,
the evaluation cadence is a function of the step, so they all save, evaluate and stop at the same
step. The end of the run (final checkpoint, export, final measurement) is the caller's
(``line.Line.finish_drafter``).
"""

from __future__ import annotations

import time
from typing import Callable

from draftline.checkpoint.manager import CheckpointManager
from draftline.evaluate.during_training import InTrainingEvaluation
from draftline.pipeline.drafter_worker import DrafterWorker, StepRecord
from draftline.pipeline.spec import RunSpec
from draftline.pipeline.transport import Delivery, FeatureReceiver

FINISHED, STOPPED = "finished", "stopped"


class TimeLimit:
    """--max-minutes: the training ends at the first step boundary past ``minutes`` from now, and the
    learning-rate schedule runs on its clock: ``progress`` goes from ``start_progress`` (where the schedule
    stood as this start began: a resume's is further along) to 1 at the limit."""

    def __init__(self, minutes: float, start_progress: float = 0.0):
        self.started = time.time()
        self.ends_at = self.started + minutes * 60
        self.start_progress = start_progress

    def up(self) -> bool:
        return time.time() >= self.ends_at

    def progress(self) -> float:
        spent = min(1.0, (time.time() - self.started) / (self.ends_at - self.started))
        return self.start_progress + (1.0 - self.start_progress) * spent


def train(spec: RunSpec, worker: DrafterWorker, receiver: FeatureReceiver, *, monitor, checkpointer: CheckpointManager,
          evaluation: InTrainingEvaluation, stop_requested: Callable[[], bool],
          time_limit: TimeLimit | None = None) -> str:
    """Train from ``spec.start_step`` to ``spec.total_steps``, or until ``time_limit``; returns "finished" or
    "stopped" (``stop_requested``: a signal; the run can continue with --resume)."""
    for step in range(spec.start_step, spec.total_steps):
        # ---- batches -> features
        deliveries = receive(receiver, spec.drafter_seqs(step), worker)
        # ---- objective: forward and backward of every pass; the gradients accumulate
        worker.accumulate(deliveries)
        # ---- the record of the step before (read one step late)
        record = worker.read_record()
        if record is not None:
            after_step(record, worker, monitor, checkpointer, evaluation)
            if record.stop or record.time_up:
                worker.drop_gradients()  # this step is not taken
                return STOPPED if record.stop else FINISHED
        # ---- step: queued, the host goes on to the next step's batches
        worker.queue_update(stop=stop_requested(), save=checkpointer.clock_due(),
                            time_up=time_limit is not None and time_limit.up(),
                            clock=0.0 if time_limit is None else time_limit.progress())
    record = worker.read_record()
    if record is not None:
        after_step(record, worker, monitor, checkpointer, evaluation)
    return FINISHED


def receive(receiver: FeatureReceiver, seqs: list[int], worker: DrafterWorker) -> list[Delivery]:
    """The features of batches ``seqs``, in order (waits for the targets that compute them)."""
    deliveries = []
    for seq in seqs:
        delivery, waited = receiver.get()
        worker.waited_for_features(waited)
        assert delivery is not None and delivery.seq == seq, f"expected batch {seq}, got {delivery and delivery.seq}"
        deliveries.append(delivery)
    return deliveries


def after_step(record: StepRecord, worker: DrafterWorker, monitor, checkpointer: CheckpointManager,
               evaluation: InTrainingEvaluation) -> None:
    """What follows a step's record: the monitor, and on their cadence a checkpoint and a measurement."""
    monitor.on_step(record, worker)
    if checkpointer.due(record.step, record.save):
        checkpointer.save()
    if evaluation.due(record.step):
        summary = evaluation.during(worker.drafter, record.step)
        if summary is not None:
            monitor.on_measurement(summary)  # the monitor's tau is the latest measured acceptance
