"""pipeline/drafter_worker.py on a GPU: a batch's passes queue their work without waiting for the device.

A synchronising call in a pass (a host number assigned into a CUDA tensor, a copy from pageable
memory) makes the host wait for every kernel in flight, and the GPU then idles while the host
prepares what comes next. The one sync a step makes on purpose is in ``finish_step`` (the gradient
norm and the stop flag, read before AdamW is queued); ``train_on`` must make none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from draftline.model.config import build_drafter_config
from draftline.pipeline.transport import Delivery

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_line import make_worker, packed_batch  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_on_makes_no_host_device_sync():
    target = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    cfg = build_drafter_config(target, num_hidden_layers=2, block_size=16, target_layer_ids=[1, 2])
    device, dtype = torch.device("cuda"), torch.bfloat16
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    # 2,048 query rows per pass: the batch below runs in several passes (the packed case).
    worker = make_worker(cfg, device, dtype, 2048, embed, head, head_chunk_rows=1024, compile_layers=False)
    width = len(cfg.dflash_config["target_layer_ids"]) * cfg.hidden_size

    def delivery(seed):
        batch = packed_batch([700, 1300, 400, 900], cfg.vocab_size, seed, seed)
        return Delivery(seed, torch.randn(batch.num_tokens, width, device=device, dtype=dtype), batch)

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
