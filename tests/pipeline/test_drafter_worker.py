"""pipeline/drafter_worker.py: a step with a non-finite loss or gradient is left out (on the device flag of
the fused AdamW: weights, moments and step counts as before), counted, and too many in a row stop training;
on a GPU, a batch's passes queue their work without waiting for the device.

A synchronising call in a pass (a host number assigned into a CUDA tensor, a copy from pageable
memory) makes the host wait for every kernel in flight, and the GPU then idles while the host
prepares what comes next. The one wait a step makes on purpose is in ``finish_step`` (the step's
record: metrics, gradient norm, stop flag, copied before the queued AdamW runs); ``train_on`` must make none.
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
    assert not worker.finish_step()
    assert worker.counters.skipped_steps == 1 and worker.counters.bad_in_a_row == 1 and worker.step == 2
    assert not math.isfinite(worker.counters.last_grad_norm)
    after = _state(worker)
    for a, b in zip(before[0], after[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] == 1.0
               for x, y in zip(before[1], after[1]))
    worker.train_on(delivery(2, lengths))
    worker.finish_step()  # good again: the weights move, the run of bad steps ends
    assert worker.counters.bad_in_a_row == 0 and worker.counters.skipped_steps == 1
    assert any(not torch.equal(a, p) for a, p in zip(after[0], worker.params))
    worker.max_bad_steps = 2
    worker.train_on(delivery(3, lengths, poison=True))
    worker.finish_step()
    worker.train_on(delivery(4, lengths, poison=True))
    with pytest.raises(DraftlineError, match="2 optimizer steps in a row had a non-finite loss or gradient"):
        worker.finish_step()


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
    assert worker.counters.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, worker.params))
