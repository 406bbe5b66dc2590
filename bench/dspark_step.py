"""DSpark's drafter step against DFlash's on one GPU, on the line's code path: time and peak memory.

    python bench/dspark_step.py --shape 8b --out dspark_step.json          # H200: the issue's goal
    python bench/dspark_step.py --shape tiny --tokens 256 --anchors 16 --block 8 --iters 2 --warmup 1 --device cpu

Each method's drafter worker comes from the product's one builder (``workloads.make_worker`` ->
``pipeline.build.build_drafter_worker``): the method's drafter and objective (``methods``), the drafter compiled on
CUDA with the default recompute policy (``model.fused``, ``model.recompute``: the layers' halves keep only their
matmul outputs), the fused AdamW with its gradient factor (``pipeline.optim``). A step is what the drafter's loop
does with one batch (``workloads.train_step``: the passes, the record of the step before, the update queued),
timed to the device's end. The workload is the issue's: one sample of ``--tokens`` tokens
(``sizing.workload.packed_batch``: the first 10% a prompt), ``--anchors`` anchors, block ``--block``, a 5-layer
drafter of the 8B shape, random weights and features (bf16 autocast over fp32 master weights). DSpark's features
carry the target's final hidden state too (K + 1 feature layers' columns), its Markov head rank ``--markov-rank``.
Prints and writes each method's median step time, peak memory and counted FLOPs, and their ratios (the issue's
goal: DSpark <= 1.10x DFlash's time and peak memory at the 8B shape, 1 x 3,072 tokens, 512 anchors).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import make_worker, packed_batch, target_config, train_step  # noqa: E402

from draftline.methods import get_method  # noqa: E402
from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.pipeline.transport import Delivery  # noqa: E402

GIB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(method_name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    target = target_config(args.shape)
    method = get_method(method_name, **({"markov_rank": args.markov_rank} if method_name == "dspark" else {}))
    config = method.build_config(build_drafter_config(target, num_hidden_layers=5, block_size=args.block))
    hidden, vocab = target.hidden_size, target.vocab_size
    embed = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    worker = make_worker(config, device, dtype, args.max_query_rows, embed, head,
                         head_chunk_rows=args.head_chunk_rows, compile_layers=not args.no_compile)
    worker.objective.settings.max_anchors = args.anchors
    width = worker.objective.feature_width
    batches = [packed_batch([args.tokens], vocab, i, i) for i in range(args.warmup + args.iters)]
    deliveries = [Delivery(b.index, torch.randn(b.num_tokens, width, device=device, dtype=dtype), b) for b in batches]
    for d in deliveries[: args.warmup]:
        train_step(worker, d)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    flops0, times = worker.counters.flops, []
    for d in deliveries[args.warmup:]:
        start = time.perf_counter()
        train_step(worker, d)
        _sync(device)
        times.append(time.perf_counter() - start)
    record = worker.read_record()
    summary = worker.objective.summarize(record.metrics)
    result = {
        "method": method.describe(config), "ms": 1000 * statistics.median(times),
        "ms_all": [round(1000 * t, 1) for t in times],
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan"),
        "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else float("nan"),
        "tflop_per_step": (worker.counters.flops - flops0) / len(times) / 1e12,
        "trained_params_m": sum(p.numel() for p in worker.params) / 1e6,
        "passes_per_step": worker.counters.passes / (args.warmup + args.iters),
        "labels_last_step": summary["num_labels"], "loss_last_step": summary["loss"],
    }
    del worker, deliveries, embed, head
    gc.collect()  # modules and hooks form cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", help="the target's shape (bench/workloads.py SHAPES; default 8b)")
    parser.add_argument("--tokens", type=int, default=3072, help="tokens of the one sample a step trains (3072)")
    parser.add_argument("--anchors", type=int, default=512, help="anchors of the sample (--max-anchors; 512)")
    parser.add_argument("--block", type=int, default=16, help="block size (16)")
    parser.add_argument("--markov-rank", type=int, default=256, help="DSpark's Markov head rank (256)")
    parser.add_argument("--max-query-rows", type=int, default=32768, help="block rows per pass (train's default)")
    parser.add_argument("--head-chunk-rows", type=int, default=4096, help="DFlash's LM-head chunk (train's default)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps (10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first: compilation, allocator (3)")
    parser.add_argument("--no-compile", action="store_true", help="eager drafter (train's --no-compile)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="compute dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    results = []
    for name in ("dflash", "dspark"):
        results.append(run(name, args, device, dtype))
        print(json.dumps(results[-1]), flush=True)
    ratio = {key: results[1][key] / results[0][key] for key in ("ms", "peak_gib", "tflop_per_step")}
    print(f"dspark / dflash: time {ratio['ms']:.3f}x, peak memory {ratio['peak_gib']:.3f}x, counted FLOPs "
          f"{ratio['tflop_per_step']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps({
            "args": vars(args) | {"out": str(args.out)}, "results": results, "ratio": ratio, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
