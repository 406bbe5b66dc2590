"""Where the target's feature pass spends its time: one packed batch under the profiler, kernels by kind.

    python bench/profile_target.py --shape 27b-hybrid --budget 32768               # on a GPU, compiled, bf16
    python bench/profile_target.py --shape 27b-hybrid --budget 32768 --fp8         # its linear layers in FP8
    python bench/profile_target.py --shape tiny-hybrid --budget 2048 --device cpu --eager   # a quick check (CPU)

The target is built as ``bench_line.py`` builds it (random weights from the shape's config, the product's
``TargetFeatures``, compiled by ``model.fused.compile_target`` unless ``--eager``), warmed up on two batches, timed
on ``--iters`` more, then one batch runs under ``torch.profiler``. The report gives the pass's MFU (the product's
FLOP counter against the spec peak), the kernels' time by kind (matmuls, attention, the linear-attention kernels,
fused Triton kernels, copies), the GPU's idle time between kernels, and the largest kernels: what a faster pass
would have to shrink.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_drafter import busy_and_gaps, kernel_kind, kernel_spans  # noqa: E402
from workloads import lognormal_lengths, packed_batch, random_target, spec_peak, sync, target_config  # noqa: E402

from draftline.model import linear_attention  # noqa: E402
from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.model.target import TargetFeatures, default_attention  # noqa: E402
from draftline.sizing.flops import TargetShape, target_flops  # noqa: E402

def profile_report(spans, flops: float, peak: float, top: int) -> tuple[list[str], dict]:
    """The kernels' time by kind and by name over one profiled pass; ``spans`` are (start, end, name) in us."""
    busy, gaps = busy_and_gaps(spans)
    wall = max(e for _, e, _ in spans) - spans[0][0]
    kinds: collections.Counter = collections.Counter()
    names: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for s, e, n in spans:
        kinds[kernel_kind(n)] += (e - s) / 1e3
        names[n] += (e - s) / 1e3
        calls[n] += 1
    lines = [f"first to last kernel {wall / 1e3:.1f} ms; busy {busy / 1e3:.1f} ms; idle between kernels "
             f"{sum(g for g, _ in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; the pass's model FLOPs over its span: "
             f"{flops / (wall / 1e6) / peak:.1%} of the spec peak"]
    for kind, ms in kinds.most_common():
        lines.append(f"  {kind:24s} {ms:9.1f} ms  {ms / (wall / 1e3):6.1%}")
    if kinds["gemm"]:
        lines.append(f"  the pass's model FLOPs over the matmuls' time alone: {flops / (kinds['gemm'] / 1e3) / peak:.1%}"
                     " of the spec peak (an upper bound on what removing everything else would give)")
    lines.append("  largest kernels (ms, calls):")
    for n, ms in names.most_common(top):
        lines.append(f"  {ms:9.2f}  x{calls[n]:4d}  {kernel_kind(n)[:12]:12s}  {n[:130]}")
    return lines, {"wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "kinds_ms": dict(kinds),
                   "top": [[n[:200], ms, calls[n]] for n, ms in names.most_common(top)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="27b-hybrid", help="the target's shape, as bench_line.py names them "
                                                              "(default: %(default)s)")
    parser.add_argument("--budget", type=int, default=32768, help="tokens a packed batch (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=5, help="timed batches before the profiled one "
                                                             "(default: %(default)s)")
    parser.add_argument("--fp8", action="store_true", help="the target's linear layers in FP8 (train's --target-fp8)")
    parser.add_argument("--eager", action="store_true", help="do not compile the pass")
    parser.add_argument("--top", type=int, default=30, help="kernels listed (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = target_config(args.shape)
    hybrid = linear_attention.is_hybrid(config)
    ids = build_drafter_config(config, num_hidden_layers=5, block_size=16).dflash_config["target_layer_ids"]
    shape = TargetShape.of(config)
    rng = np.random.default_rng(0)
    batches = [packed_batch(lognormal_lengths(rng, args.budget), shape.vocab_size, i, i) for i in range(args.iters + 3)]
    torch.manual_seed(0)
    target = TargetFeatures.from_model(random_target(args.shape, device, dtype, default_attention(device, hybrid)),
                                       ids, fp8=args.fp8)
    if not args.eager:
        from draftline.model.fused import compile_target

        compile_target(target)
    for b in batches[:2]:
        target(b)
    sync(device)
    times, flops = [], []
    for b in batches[2:-1]:
        start = time.perf_counter()
        target(b)
        sync(device)
        times.append(time.perf_counter() - start)
        flops.append(target_flops(shape, b.doc_lengths, max(ids) + 1))
    peak = spec_peak(device) if device.type == "cuda" else float("nan")
    mfu = sum(flops) / sum(times) / peak
    each = [f / t / peak for f, t in zip(flops, times)]
    variant = f"{args.shape}, {'eager' if args.eager else 'compiled'}{', FP8' if args.fp8 else ''}, {args.budget} tok"
    lines = [f"{variant}: {sum(b.num_tokens for b in batches[2:-1]) / sum(times):,.0f} tok/s, {mfu:.1%} of the spec "
             f"peak over the timed batches; each batch: {', '.join(f'{1e3 * t:.0f} ms {m:.1%}' for t, m in zip(times, each))}"
             f" (median {statistics.median(each):.1%})"]
    from torch.profiler import ProfilerActivity, profile

    last = batches[-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        target(last)
        sync(device)
    spans = kernel_spans(prof)
    report = {"variant": variant, "ms_per_batch": [1e3 * t for t in times], "mfu_spec": mfu, "mfu_each": each}
    if spans:
        more, report["profile"] = profile_report(spans, target_flops(shape, last.doc_lengths, max(ids) + 1), peak,
                                                 args.top)
        lines += more
    else:
        lines.append("no device kernels recorded (the profile needs a GPU)")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
