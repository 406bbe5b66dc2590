"""The target's feature pass for a Qwen3.6-27B-shaped hybrid target (Gated DeltaNet + gated attention).

    python bench/bench_target.py                       # on a GPU with flash-linear-attention
    python bench/bench_target.py --shape tiny --budgets 2048 --device cuda   # a quick check

Random bf16 weights built on the device from the config (weights do not matter for speed), only the
layers up to the deepest feature layer (61 of 64 for target_layer_ids [1, 16, 31, 46, 61]). Packed
batches of log-normal document lengths (mean ~2.8K, capped at 8K) filling each token budget. Per
budget: Ktok/s, TFLOP/s, MFU against the spec peak and against the measured matmul ceiling, peak
memory. ``--check-docs N``: the first N documents of a batch run alone, compared with the same rows of
the packed pass, per feature layer: ||difference|| / ||feature|| (norm-relative, worst document) and,
coarser, max |difference| / mean |feature|.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from workloads import HYBRID_SHAPES as SHAPES, hybrid_config, lognormal_lengths  # noqa: F401  (the same length mix as the drafter rows)
from draftline.data.batch import PackedBatch
from draftline.model import linear_attention
from draftline.model.config import build_drafter_config
from draftline.model.target import TargetFeatures
from draftline.sizing.flops import TargetShape, format_flops, resolve_peak, target_flops

def random_target(config, layers_run: int, device: torch.device, dtype: torch.dtype):
    """The model with only its first ``layers_run`` layers, built on ``device`` in ``dtype``."""
    from transformers import Qwen3_5ForCausalLM

    config.num_hidden_layers = layers_run
    config.layer_types = config.layer_types[:layers_run]
    config._attn_implementation = linear_attention.register_packed_flex() if device.type == "cuda" else "sdpa"
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def packed_batch(lengths: list[int], vocab: int, seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = [(torch.randint(0, vocab - 1, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    return PackedBatch.from_documents(docs, index=seed)


def bench_budget(target, shape, layers_run, budget, iters, device, peak) -> dict:
    rng = np.random.default_rng(budget)
    batches = [packed_batch(lognormal_lengths(rng, budget), shape.vocab_size, i) for i in range(iters + 2)]
    for batch in batches[:2]:  # compile flex, autotune the Triton kernels
        target(batch)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times, flops, tokens, docs = [], 0.0, 0, 0
    for batch in batches[2:]:
        start = time.perf_counter()
        target(batch)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        flops += target_flops(shape, batch.doc_lengths, layers_run)
        tokens += batch.num_tokens
        docs += batch.num_docs
    wall = sum(times)
    rate = flops / wall
    return {"budget": budget, "tokens": tokens, "docs": docs, "ktok_s": tokens / wall / 1e3,
            "tflops": rate / 1e12, "mfu": rate / peak.flops, "mfu_ceiling": rate / peak.ceiling if peak.ceiling else None,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "ms_per_batch": [round(t * 1e3, 1) for t in times]}


def check_documents(target, shape, budget, num_docs) -> tuple[list[float], list[float]]:
    """Packed vs each document alone, per feature layer: max |difference| / mean |feature|, and the
    norm of the difference over the norm of the feature (worst document)."""
    rng = np.random.default_rng(budget + 1)
    lengths = lognormal_lengths(rng, budget)
    batch = packed_batch(lengths, shape.vocab_size, 99)
    packed = target(batch).float()
    hidden = target.hidden_size
    worst = [0.0] * (packed.shape[1] // hidden)
    relative = [0.0] * len(worst)
    start = 0
    for index, n in enumerate(lengths[:num_docs]):
        ids = batch.input_ids[start : start + n].tolist()
        alone = target(PackedBatch.from_documents([(ids, [True] * n)])).float()
        rows = packed[start : start + n]
        for k in range(len(worst)):
            a, b = rows[:, k * hidden : (k + 1) * hidden], alone[:, k * hidden : (k + 1) * hidden]
            worst[k] = max(worst[k], float((a - b).abs().max() / b.abs().mean()))
            relative[k] = max(relative[k], float((a - b).norm() / b.norm()))
        start += n
    return worst, relative


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32768, 49152])
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--check-docs", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        print("bench_target measures the GPU path; pass --device cuda", file=sys.stderr)
        return 2
    config = hybrid_config(args.shape)
    drafter = build_drafter_config(config)
    layer_ids = drafter.dflash_config["target_layer_ids"]
    layers_run = max(layer_ids) + 1
    shape = TargetShape.of(config)
    peak = resolve_peak(device)
    start = time.perf_counter()
    model = random_target(config, layers_run, device, torch.bfloat16)
    target = TargetFeatures.from_model(model, layer_ids)
    print(f"{args.shape}: {layers_run} of {shape.num_layers} layers, features {layer_ids}, built in "
          f"{time.perf_counter() - start:.0f} s, weights {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB; "
          f"MFU against {peak.describe()}", flush=True)
    rows = []
    for budget in args.budgets:
        row = bench_budget(target, shape, layers_run, budget, args.iters, device, peak)
        rows.append(row)
        print(f"packed {budget:>6} tokens ({row['docs']} docs in {args.iters} batches): {row['ktok_s']:.2f} Ktok/s, "
              f"{format_flops(row['tflops'] * 1e12)}/s, MFU {row['mfu']:.1%} "
              f"({row['mfu_ceiling']:.1%} of ceiling), peak {row['peak_gib']:.1f} GiB, ms/batch {row['ms_per_batch']}",
              flush=True)
    result = {"shape": args.shape, "layers_run": layers_run, "peak": peak.flops, "ceiling": peak.ceiling, "rows": rows}
    if args.check_docs:
        worst, relative = check_documents(target, shape, args.budgets[0], args.check_docs)
        result["packed_vs_alone"] = worst
        result["packed_vs_alone_norm"] = relative
        print(f"packed vs alone, first {args.check_docs} documents, ||diff|| / ||feature|| (worst document) per "
              f"feature layer {layer_ids}: " + ", ".join(f"{r:.2e}" for r in relative), flush=True)
        print("packed vs alone, max|diff| / mean|feature| per feature layer: "
              + ", ".join(f"{w:.2e}" for w in worst), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
