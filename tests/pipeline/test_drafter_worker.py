"""pipeline/drafter_worker.py and pipeline/loop.py: a step with a non-finite loss or gradient is left out (on the
device flag of the fused AdamW: weights, moments and step counts as before), counted, and too many in a row stop
training; a step's record is read one step late and what it decides stays exact (a stop agreed at step k leaves
step k + 1 untaken); on a GPU, a batch's passes queue their work without waiting for the device.

A synchronising call in a pass (a host number assigned into a CUDA tensor, a copy from pageable
memory) makes the host wait for every kernel in flight, and the GPU then idles while the host
prepares what comes next. The one wait a step makes on purpose is ``read_record`` (the record of
the step before: metrics, gradient norm, stop flag); ``accumulate`` must make none.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftline.errors import DraftlineError
from draftline.pipeline import loop
from draftline.pipeline.spec import RunSpec
from helpers import tiny_drafter_worker

LENGTHS = (72, 40)


def _state(worker):
    params = [p.detach().clone() for p in worker.params]
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"]))
               for s in (worker.optimizer.state[p] for p in worker.params)]
    return params, moments


def _step(worker, delivery):
    """One step in the loop's order: this step's passes, the step before's record, this step's update."""
    worker.accumulate([delivery])
    record = worker.read_record()
    worker.queue_update()
    return record


def test_a_non_finite_step_is_left_out_counted_and_too_many_stop_training():
    torch.manual_seed(0)
    worker, delivery = tiny_drafter_worker(torch.device("cpu"), torch.float32, max_anchors=16)
    _step(worker, delivery(0, LENGTHS))  # a good step: the moments exist
    before = _state(worker)
    record = _step(worker, delivery(1, LENGTHS, poison=True))  # reads step 1's record, queues step 2
    assert record.step == 1 and record.finite
    assert worker.step == 2 and worker.progress.skipped_steps == 0  # step 2's record is read one step late
    record = worker.read_record()
    assert record.step == 2 and not record.finite
    assert worker.progress.skipped_steps == 1 and worker.counters.bad_in_a_row == 1
    assert not math.isfinite(worker.counters.last_grad_norm)
    after = _state(worker)
    for a, b in zip(before[0], after[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] == 1.0
               for x, y in zip(before[1], after[1]))
    _step(worker, delivery(2, LENGTHS))  # good again: the weights move, the run of bad steps ends
    worker.read_record()
    assert worker.counters.bad_in_a_row == 0 and worker.progress.skipped_steps == 1
    assert any(not torch.equal(a, p) for a, p in zip(after[0], worker.params))
    worker.max_bad_steps = 2
    _step(worker, delivery(3, LENGTHS, poison=True))
    _step(worker, delivery(4, LENGTHS, poison=True))  # reads step 4's record: one bad step so far
    with pytest.raises(DraftlineError, match="2 optimizer steps in a row had a non-finite loss or gradient"):
        worker.read_record()


class _Receiver:
    def __init__(self, deliveries):
        self.deliveries = list(deliveries)

    def get(self):
        return (self.deliveries.pop(0) if self.deliveries else None), 0.0


class _Monitor:
    def __init__(self):
        self.records, self.measured = [], {}

    def on_step(self, record, worker):
        self.records.append((record.step, record.loss))


class _Never:
    def clock_due(self):
        return False

    def due(self, *_):
        return False


def _train(steps: int, stop_at: int | None = None):
    torch.manual_seed(0)
    worker, delivery = tiny_drafter_worker(torch.device("cpu"), torch.float32, max_anchors=16)
    spec = RunSpec.standalone(_config(), None, torch.device("cpu"), total_steps=steps)
    monitor = _Monitor()
    status = loop.train(spec, worker, _Receiver(delivery(s, LENGTHS) for s in range(steps)), monitor=monitor,
                        checkpointer=_Never(), evaluation=_Never(),
                        stop_requested=lambda: stop_at is not None and worker.step + 1 == stop_at)  # asked during it
    return status, worker, monitor.records


def _config():
    from draftline.config import TrainConfig

    return TrainConfig()


def test_the_loop_accounts_every_record_once_in_order_and_a_stop_leaves_the_next_step_untaken():
    status, reference, seen = _train(3)
    assert status == loop.FINISHED and [step for step, _ in seen] == [1, 2, 3]  # each step once, in order
    assert reference.read_record() is None  # nothing left to read

    status, stopped, seen_stopped = _train(4, stop_at=2)  # asked during step 2: agreed in its record
    assert status == loop.STOPPED and stopped.step == 2
    assert seen_stopped == seen[:2]  # the same losses as the run that went on
    assert all(p.grad is None for p in stopped.params)  # step 3's batch was trained, its gradients dropped
    _, two_steps, _ = _train(2)
    for a, b in zip(stopped.params, two_steps.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the weights of exactly two steps


def test_a_failures_read_of_the_last_record_counts_it_without_raising():
    torch.manual_seed(0)
    worker, delivery = tiny_drafter_worker(torch.device("cpu"), torch.float32, max_bad_steps=1, max_anchors=16)
    worker.accumulate([delivery(0, LENGTHS, poison=True)])
    worker.queue_update()
    assert worker.read_record(check=False).step == 1
    assert worker.progress.skipped_steps == 1  # counted; no raise at the limit
    assert worker.read_record() is None  # read once only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accumulate_makes_no_host_device_sync():
    device, dtype = torch.device("cuda"), torch.bfloat16
    # 2,048 query rows per pass: the batch below runs in several passes (the packed case).
    worker, delivery = tiny_drafter_worker(device, dtype, 2048, head_chunk_rows=1024)
    _step(worker, delivery(0))  # compiles flex's kernels (which may sync)
    passes = worker.counters.passes
    d = delivery(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        worker.accumulate([d])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert worker.counters.passes - passes >= 2
    worker.read_record()
    worker.queue_update()
    # A bad step on the GPU: left out by the fused kernel's flag, as on CPU.
    before = [p.detach().clone() for p in worker.params]
    _step(worker, delivery(2, poison=True))
    worker.read_record()
    assert worker.progress.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, worker.params))
