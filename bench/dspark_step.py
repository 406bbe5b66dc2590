"""DSpark's drafter step against DFlash's on one GPU: time and peak memory, the objective alone.

    python bench/dspark_step.py --shape 8b --out dspark_step.json      # on a GPU (H200: the issue's goal)
    python bench/dspark_step.py --shape tiny --iters 2 --device cpu    # a smoke run

One sample of ``--tokens`` tokens (one document, every token trained), ``--anchors`` anchors, block ``--block``,
a 5-layer drafter of the shape, random weights and features (bf16 autocast over fp32 master weights, as the line
trains). A step is what a drafter does with one batch outside the line: the objective's forward and backward
over one pass holding every anchor, and a fused AdamW step over the trained weights. Each method builds its
drafter and objective through ``methods.get_method``; DSpark's features carry the target's final hidden state
too (K + 1 layers). ``--compile`` compiles the drafter's dense parts as the line does on CUDA. Prints and
writes the median step time and the peak memory of each method and their ratio (the issue's goal: DSpark <=
1.10x DFlash's time and peak memory at the 8B shape, 1 x 3,072 tokens, 512 anchors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import target_config  # noqa: E402

from draftline.data.batch import PackedBatch  # noqa: E402
from draftline.methods import get_method  # noqa: E402
from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.objective.loss import ObjectiveSettings  # noqa: E402

GIB = 2**30


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(method_name: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    target = target_config(args.shape)
    method = get_method(method_name)
    config = method.build_config(build_drafter_config(target, num_hidden_layers=5, block_size=args.block))
    drafter = method.build_drafter(config).to(device)
    if args.compile and device.type == "cuda":
        from draftline.model.fused import compile_drafter

        compile_drafter(drafter)
    hidden, vocab = target.hidden_size, target.vocab_size
    embed = (torch.randn(vocab, hidden, device=device) * 0.02).bfloat16()
    head = (torch.randn(vocab, hidden, device=device) * 0.02).bfloat16()
    settings = ObjectiveSettings(max_anchors=args.anchors, attention="auto", head_chunk_rows=args.head_chunk_rows)
    objective = method.objective(drafter, embed, head, settings)
    ids = torch.randint(0, vocab - 1, (args.tokens,)).tolist()
    batch = PackedBatch.from_documents([(ids, [True] * args.tokens)])
    features = torch.randn(args.tokens, objective.feature_width, device=device).bfloat16()
    # One pass holds every anchor on GPU; the dense path (CPU) splits it, and only its first pass runs here.
    part, blocks_host = next(iter(objective.passes(batch, args.anchors, dense=objective.dense_attention(device))))
    blocks = blocks_host.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.iters):
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss_sum, metrics = objective(features[part.token_lo:part.token_hi], blocks)
        loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    return {"method": method_name, "ms": 1000 * statistics.median(times), "peak_gib": peak,
            "params_m": sum(p.numel() for p in params) / 1e6, "rows": blocks.num_anchors * args.block,
            "labels": int(blocks.label_rows.numel()), "loss": float(loss_sum.detach()) / float(metrics[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--head-chunk-rows", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for name in ("dflash", "dspark"):
        results.append(run(name, args, device))
        print(json.dumps(results[-1]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ratio = {"time": results[1]["ms"] / results[0]["ms"], "peak": results[1]["peak_gib"] / results[0]["peak_gib"]}
    print(f"dspark / dflash: time {ratio['time']:.3f}x, peak memory {ratio['peak']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results,
                                        "ratio": ratio, "torch": torch.__version__,
                                        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                        else "cpu"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
