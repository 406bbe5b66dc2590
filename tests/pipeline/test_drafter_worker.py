"""pipeline/drafter_worker.py: a step with a non-finite loss or gradient is left out (on the device flag of
the fused AdamW: weights, moments and step counts as before), counted, and too many in a row stop training;
a step's record is read one step late and what it decides stays exact (a stop agreed at step k leaves
step k + 1 untaken); on a GPU, a batch's passes queue their work without waiting for the device.

A synchronising call in a pass (a host number assigned into a CUDA tensor, a copy from pageable
memory) makes the host wait for every kernel in flight, and the GPU then idles while the host
prepares what comes next. The one wait a step makes on purpose is in ``finish_step`` (the record of
the step before: metrics, gradient norm, stop flag); ``train_on`` must make none.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.pipeline.transport import Delivery

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_line import make_worker, packed_batch  # noqa: E402



def _tiny_worker(device, dtype, max_query_rows=2048, **kwargs):
    target = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    cfg = build_drafter_config(target, num_hidden_layers=2, block_size=16, target_layer_ids=[1, 2])
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    worker = make_worker(cfg, device, dtype, max_query_rows, embed, head, **kwargs)
    width = len(cfg.dflash_config["target_layer_ids"]) * cfg.hidden_size

    def delivery(seed, lengths=(700, 1300, 400, 900), poison=False):
        batch = packed_batch(list(lengths), cfg.vocab_size, seed, seed)
        features = torch.randn(batch.num_tokens, width, device=device, dtype=dtype)
        if poison:
            features[5, 3] = float("nan")
        return Delivery(seed, features, batch)

    return worker, delivery


def _state(worker):
    params = [p.detach().clone() for p in worker.params]
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"]))
               for s in (worker.optimizer.state[p] for p in worker.params)]
    return params, moments


def test_a_non_finite_step_is_left_out_counted_and_too_many_stop_training():
    torch.manual_seed(0)
    worker, delivery = _tiny_worker(torch.device("cpu"), torch.float32, compile_layers=False)
    lengths = (300, 200)
    worker.train_on(delivery(0, lengths))
    worker.finish_step()  # a good step: the moments exist
    before = _state(worker)
    worker.train_on(delivery(1, lengths, poison=True))
    assert not worker.finish_step()  # reads step 1's record, queues step 2
    assert worker.step == 2 and worker.counters.skipped_steps == 0  # step 2's record is read one step late
    assert not worker.settle()
    assert worker.counters.skipped_steps == 1 and worker.counters.bad_in_a_row == 1
    assert not math.isfinite(worker.counters.last_grad_norm)
    after = _state(worker)
    for a, b in zip(before[0], after[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] == 1.0
               for x, y in zip(before[1], after[1]))
    worker.train_on(delivery(2, lengths))
    worker.finish_step()  # good again: the weights move, the run of bad steps ends
    worker.settle()
    assert worker.counters.bad_in_a_row == 0 and worker.counters.skipped_steps == 1
    assert any(not torch.equal(a, p) for a, p in zip(after[0], worker.params))
    worker.max_bad_steps = 2
    worker.train_on(delivery(3, lengths, poison=True))
    worker.finish_step()
    worker.train_on(delivery(4, lengths, poison=True))
    worker.finish_step()  # reads step 4's record: one bad step so far
    with pytest.raises(DraftlineError, match="2 optimizer steps in a row had a non-finite loss or gradient"):
        worker.settle()


def test_a_stop_agreed_at_a_step_leaves_the_next_untaken_and_each_record_is_read_once_in_order():
    lengths = (300, 200)

    def worker_with_log(stop_at=None):
        torch.manual_seed(0)
        worker, delivery = _tiny_worker(torch.device("cpu"), torch.float32, compile_layers=False)
        seen = []
        worker.on_step = lambda w, vector: seen.append((w.step, float(vector[0])))
        worker.stop_requested = lambda: stop_at is not None and worker.step + 1 == stop_at  # asked during step stop_at
        return worker, delivery, seen

    reference, delivery, ref_seen = worker_with_log()
    for seed in range(3):
        reference.train_on(delivery(seed, lengths))
        assert not reference.finish_step()
    reference.settle()
    assert [step for step, _ in ref_seen] == [1, 2, 3]  # every step accounted once, in order
    assert not reference.settle()  # nothing left to read

    worker, delivery, seen = worker_with_log(stop_at=2)
    for seed in range(2):
        worker.train_on(delivery(seed, lengths))
        assert not worker.finish_step()
    worker.train_on(delivery(2, lengths))  # step 3's batch: trained before step 2's record is read
    assert worker.finish_step()  # step 2 agreed to stop: step 3 is not taken
    assert worker.step == 2 and [step for step, _ in seen] == [1, 2]
    assert seen == ref_seen[:2]  # the same losses as the run that went on
    assert all(p.grad is None for p in worker.params)  # step 3's gradients dropped
    two_steps, _ = worker_with_log()[:2]
    for seed in range(2):
        two_steps.train_on(delivery(seed, lengths))
        two_steps.finish_step()
    two_steps.settle()
    for a, b in zip(worker.params, two_steps.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the weights of exactly two steps


def test_settle_before_a_failures_checkpoint_counts_the_last_step_without_callbacks_or_raising():
    torch.manual_seed(0)
    worker, delivery = _tiny_worker(torch.device("cpu"), torch.float32, compile_layers=False)
    seen = []
    worker.on_step = lambda w, vector: seen.append(w.step)
    worker.max_bad_steps = 1
    worker.train_on(delivery(0, (300, 200), poison=True))
    worker.finish_step()
    assert not worker.settle(notify=False)
    assert worker.counters.skipped_steps == 1 and seen == []  # counted; no monitor, no checkpoint, no raise
    assert not worker.settle()  # read once only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_on_makes_no_host_device_sync():
    device, dtype = torch.device("cuda"), torch.bfloat16
    # 2,048 query rows per pass: the batch below runs in several passes (the packed case).
    worker, delivery = _tiny_worker(device, dtype, 2048, head_chunk_rows=1024, compile_layers=False)
    worker.train_on(delivery(0))  # compiles flex's kernels (which may sync)
    worker.finish_step()
    passes = worker.counters.passes
    d = delivery(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        worker.train_on(d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert worker.counters.passes - passes >= 2
    worker.finish_step()
    # A bad step on the GPU: left out by the fused kernel's flag, as on CPU.
    before = [p.detach().clone() for p in worker.params]
    worker.train_on(delivery(2, poison=True))
    worker.finish_step()
    worker.settle()
    assert worker.counters.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, worker.params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_update_overlapped_on_a_second_stream_equals_the_update_in_line():
    """AdamW per layer on a second stream, each layer's next forward waiting for its own chunk: the
    same weights and moments, bit for bit, as the update on the main stream, over several steps."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        worker, delivery = _tiny_worker(device, dtype, 2048, head_chunk_rows=1024, compile_layers=False,
                                        overlap_update=overlap)
        losses = []
        worker.on_step = lambda w, vector: losses.append(float(vector[0]))
        for seed in range(4):
            worker.train_on(delivery(seed))
            worker.finish_step()
        worker.settle()
        torch.cuda.synchronize()
        runs.append((_state(worker), losses))
    (serial, serial_losses), (overlapped, overlapped_losses) = runs
    assert serial_losses == overlapped_losses and len(serial_losses) == 4
    for a, b in zip(serial[0], overlapped[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(serial[1], overlapped[1]):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] == 4.0
