"""Where the drafter step's time and memory go: variants of the step, timed and profiled in one process.

    python bench/profile_drafter.py --variants eager,compile --out /tmp/prof   # on a GPU

Each variant builds a fresh drafter worker (workloads.make_worker, the product's builder), warms it up,
times ``--iters`` steps (``workloads.train_step``, synchronised; median ms/sample), and records peak memory per phase of one
step (forward, backward, optimizer). Optionally (``--detail``) it also lists the tensors saved for
backward by source line (autograd saved-tensor hooks, eager only) and the top CUDA kernels of one
step (torch.profiler). Variants (comma-separated, each a '+'-joined set of options):
  eager        the step as configured (no compilation), the fused head loss if present
  plainhead    the eager in-place head loss even on CUDA
  compile      draftline.model.fused.compile_drafter
  ckpt         activation checkpointing of every decoder layer
  chunk2048    2,048 rows of logits per head chunk (default 4,096)
  packed       the packed 32K-token workload instead of 1 x 3,072 tokens
  flash        the drafter's attention on FlashAttention-4's kernels (``--attention flash``)
With ``--detail`` the profiled step also reports where the GPU sat idle (gaps between kernels, and
the CUDA runtime calls the host spent its time in) and every host-device synchronisation the step
makes (``torch.cuda.set_sync_debug_mode``), by draftline source line. ``--trace-steps N`` profiles N
steps back to back (three times: as trained, with each step's record read at once, as trained) and
gives each step's time, GPU busy and idle time and kernel groups.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import lognormal_lengths, make_worker, packed_batch, target_config, train_step  # noqa: E402

from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.monitor.clocks import ClockWatch  # noqa: E402
from draftline.sizing.flops import resolve_peak  # noqa: E402
from draftline.pipeline.transport import Delivery  # noqa: E402

GIB = 2**30


def saved_tensor_report(worker, delivery, device, dtype) -> list[str]:
    """Bytes saved for backward during one forward, grouped by the draftline source line that saved them."""
    by_line: dict[str, list] = collections.defaultdict(lambda: [0, 0, set()])
    seen: set[int] = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr() if t.device.type == "cuda" else id(t)
        if ptr not in seen and t.device.type == "cuda":
            seen.add(ptr)
            frames = [f for f in traceback.extract_stack()[:-1] if "draftline" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].line[:60]}" if frames else "?"
            entry = by_line[where]
            entry[0] += t.untyped_storage().nbytes()
            entry[1] += 1
            entry[2].add(f"{tuple(t.shape)} {str(t.dtype)[6:]}")
        return t

    objective = worker.objective
    blocks = objective.blocks(delivery.batch).pin_memory().to(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device.type, dtype=dtype):
            loss, _ = objective(delivery.features, blocks)
    total = sum(v[0] for v in by_line.values())
    lines = [f"saved for backward: {total / GIB:.2f} GiB in {sum(v[1] for v in by_line.values())} storages"]
    for where, (nbytes, count, shapes) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:30]:
        lines.append(f"  {nbytes / GIB:7.3f} GiB  x{count:3d}  {where}  {sorted(shapes)[:2]}")
    del loss
    worker.optimizer.zero_grad(set_to_none=False)
    return lines


def phase_memory(worker, delivery, device, dtype) -> dict:
    """Peak allocated GiB in each phase of one single-pass step."""
    objective = worker.objective
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = {"start": torch.cuda.memory_allocated() / GIB}
    blocks = objective.blocks(delivery.batch).pin_memory().to(device)
    with torch.autocast(device.type, dtype=dtype):
        loss, _ = objective(delivery.features, blocks)
    torch.cuda.synchronize()
    out["after_forward"] = torch.cuda.memory_allocated() / GIB
    out["peak_forward"] = torch.cuda.max_memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    del loss
    torch.cuda.synchronize()
    out["peak_backward"] = torch.cuda.max_memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    worker.read_record()
    worker.queue_update()
    torch.cuda.synchronize()
    out["peak_optimizer"] = torch.cuda.max_memory_allocated() / GIB
    out["end"] = torch.cuda.memory_allocated() / GIB
    return out


def kernel_report(worker, delivery, top: int) -> tuple[list[str], dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(worker, delivery)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    kernel_total = sum(e.device_time_total for e in events) / 1e6
    lines = [f"one profiled step: wall {1000 * wall:.1f} ms (profiler on), GPU kernels {1000 * kernel_total:.1f} ms"]
    groups = collections.Counter()
    for e in events:
        groups[kernel_kind(e.key)] += e.device_time_total / 1e3
    for kind, ms in groups.most_common():
        lines.append(f"  {kind:28s} {ms:8.1f} ms")
    lines += idle_report(prof, wall)
    lines.append("  top kernels:")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        lines.append(f"  {e.device_time_total / 1e3:8.2f} ms  x{e.count:4d}  {e.key[:110]}")
    return lines, {"wall_ms": 1000 * wall, "kernel_ms": 1000 * kernel_total, "groups_ms": dict(groups)}


LINEAR_ATTENTION = ("chunk_", "gated_delta", "fused_recurrent", "solve_tril", "l2norm_fwd", "causal_conv1d",
                    "recompute_w_u", "kkt")
"""Names of flash-linear-attention's kernels (a hybrid target's Gated DeltaNet layers)."""


def kernel_kind(name: str) -> str:
    """The group a CUDA kernel's time is reported under (the drafter's step and the target's pass)."""
    name = name.lower()
    return ("linear attention (fla)" if any(k in name for k in LINEAR_ATTENTION) else
            "flex/attention" if any(k in name for k in ("flex", "attention", "triton_tem", "flash", "fmha")) else
            "gemm" if any(k in name for k in ("gemm", "cutlass", "sm90_x", "sm100", "nvjet", "matmul", "scaled_mm",
                                              "cublas")) else
            "adam/optimizer" if any(k in name for k in ("adam", "foreach", "multi_tensor")) else
            "triton (fused)" if "triton" in name else
            "copy/cast" if any(k in name for k in ("copy", "cast", "memcpy", "memset", "fill")) else
            "other elementwise/reduce")


def trace_steps(worker, deliveries, settle_each: bool = False, top: int = 0) -> list[str]:
    """Steps back to back (as trained: no sync but the worker's own) under the profiler; per step, from
    the GPU's timeline: time from one step's record copy to the next, kernel busy time, idle, and the
    kernel groups. A step whose matmuls alone take longer ran at a lower clock; one with more idle
    waited for the host. ``settle_each``: read each step's record right after queueing it (the order
    before the host ran a step ahead), for comparison in one process."""
    from torch.profiler import ProfilerActivity, profile

    worker.read_record()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for d in deliveries:
            train_step(worker, d)
            if settle_each:
                worker.read_record()
        worker.read_record()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    spans = kernel_spans(prof)
    marks = [lo for lo, _, name in spans if "dtoh" in name.lower().replace(" ", "")]  # the step's record copy
    order = "each record read at once (the old order)" if settle_each else "records read one step late (as trained)"
    lines = [f"{len(deliveries)} steps back to back under the profiler, {order}; {len(marks)} record copies found"]
    kinds = ("gemm", "flex/attention", "triton (fused)", "adam/optimizer")
    lines.append(f"  {'step':>4s} {'ms':>7s} {'busy':>7s} {'idle':>6s} {'gaps':>5s} " + " ".join(f"{k[:10]:>10s}" for k in kinds))
    for i, (lo, hi) in enumerate(zip(marks, marks[1:])):
        inside = [span for span in spans if lo <= span[0] < hi]
        busy, gaps = busy_and_gaps(inside)
        groups: collections.Counter = collections.Counter()
        for s, e, n in inside:
            groups[kernel_kind(n)] += (e - s) / 1e3
        lines.append(f"  {i + 1:4d} {(hi - lo) / 1e3:7.1f} {busy / 1e3:7.1f} {sum(g for g, _ in gaps) / 1e3:6.1f} "
                     f"{len(gaps):5d} " + " ".join(f"{groups[k]:10.1f}" for k in kinds))
    lines += idle_report(prof, wall)[1:]
    if top:
        steps = max(1, len(marks) - 1)
        by_name: collections.Counter = collections.Counter()
        calls: collections.Counter = collections.Counter()
        for s, e, n in spans:
            if marks[0] <= s < marks[-1]:
                by_name[n] += (e - s) / 1e3 / steps
                calls[n] += 1
        lines.append("  kernels, ms per step (calls per step), largest first:")
        for n, ms in by_name.most_common(top):
            lines.append(f"  {ms:7.2f}  x{calls[n] / steps:5.1f}  {kernel_kind(n)[:10]:10s}  {n[:120]}")
    return lines


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) of every CUDA kernel and copy the profiler saw, in start order; the GPU-side
    annotations (``Optimizer.step#...``, ``## ... ##``) span kernels and are left out."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
                  and not e.name.startswith(("Optimizer.", "## ")))


def busy_and_gaps(spans) -> tuple[float, list[tuple[float, float]]]:
    """The union of the spans' intervals (busy time) and the gaps between them as (length, where it starts)."""
    busy, gaps, end = 0.0, [], None
    for start, stop, *_ in spans:
        if end is not None and start > end:
            gaps.append((start - end, end))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        end = stop if end is None else max(end, stop)
    return busy, gaps


def idle_report(prof, wall: float) -> list[str]:
    """GPU busy time (the union of kernel intervals) against wall time, the largest gaps, and the CUDA
    runtime calls by total host time (a long cudaStreamSynchronize is the host waiting for the GPU)."""
    events = prof.events()
    spans = kernel_spans(prof)
    if not spans:
        return ["  no kernel intervals recorded"]
    busy, gaps = busy_and_gaps(spans)
    first, last = spans[0][0], max(stop for _, stop, _ in spans)
    lines = [f"  GPU busy {busy / 1e3:.1f} ms (union of kernels) from first to last kernel "
             f"{(last - first) / 1e3:.1f} ms; wall {1e3 * wall:.1f} ms; "
             f"{len(gaps)} gaps, {sum(g for g, _ in gaps) / 1e3:.1f} ms idle between kernels"]
    for gap, at in sorted(gaps, reverse=True)[:8]:
        cpu = [e.name for e in events if e.device_type.name == "CPU" and e.time_range.start <= at + gap
               and e.time_range.end >= at and e.name.startswith(("cuda", "aten::", "Torch-Compiled", "CompiledFunction",
                                                                "## ", "flex", "Optimizer", "autograd"))]
        lines.append(f"    gap {gap / 1e3:6.2f} ms at +{(at - first) / 1e3:7.1f} ms; host in: "
                     f"{', '.join(list(dict.fromkeys(cpu))[:6])[:200]}")
    runtime = collections.Counter()
    counts = collections.Counter()
    for e in events:
        if e.device_type.name == "CPU" and e.name.startswith("cuda"):
            runtime[e.name] += e.time_range.end - e.time_range.start
            counts[e.name] += 1
    lines.append("  CUDA runtime calls (host ms, count): " + "; ".join(
        f"{name} {us / 1e3:.1f} x{counts[name]}" for name, us in runtime.most_common(6)))
    return lines


def sync_report(worker, delivery) -> list[str]:
    """Every synchronising CUDA call of one step, by the draftline line that made it."""
    import warnings

    where: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "draftline" in f.filename or "bench" in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:])) or "?"
        where[f"{str(message)[:60]} | {key}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(worker, delivery)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"host-device syncs in one step: {sum(where.values())}"] + [f"  x{n:3d}  {k}" for k, n in where.most_common(12)]


def run_variant(name: str, args, device, dtype, peak) -> dict:
    opts = set(name.split("+"))
    cfg = build_drafter_config(target_config("8b"), num_hidden_layers=5, block_size=16)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    width = len(cfg.dflash_config["target_layer_ids"]) * hidden
    torch.manual_seed(0)
    embed = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    worker = make_worker(cfg, device, dtype, args.max_query_rows, embed, head,
                         compile_layers="compile" in opts, attention="flash" if "flash" in opts else "auto")
    worker.objective.settings.fused_head = "plainhead" not in opts
    if "chunk2048" in opts:
        worker.objective.settings.head_chunk_rows = 2048
    if "ckpt" in opts:
        from draftline.model.drafter import checkpoint_layers

        checkpoint_layers(worker.drafter)
    n = args.iters + args.warmup
    if "packed" in opts:
        batches = [packed_batch(lognormal_lengths(np.random.default_rng(i), 32768), vocab, i, i) for i in range(n)]
    else:
        batches = [packed_batch([3072], vocab, i, i) for i in range(n)]
    deliveries = [Delivery(b.index, torch.randn(b.num_tokens, width, device=device, dtype=dtype), b) for b in batches]
    result: dict = {"variant": name}
    t0 = time.perf_counter()
    for d in deliveries[: args.warmup]:
        train_step(worker, d)
    torch.cuda.synchronize()
    result["warmup_s"] = time.perf_counter() - t0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    flops0 = worker.counters.flops
    times, samples = [], 0
    with ClockWatch(device) as clock:
        for d in deliveries[args.warmup :]:
            start = time.perf_counter()
            train_step(worker, d)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            samples += d.batch.num_docs
    per_sample = [t / d.batch.num_docs for t, d in zip(times, deliveries[args.warmup :])]
    flops = worker.counters.flops - flops0
    result.update(
        ms_per_sample_median=1000 * statistics.median(per_sample),
        ms_per_sample_all=[round(1000 * t, 1) for t in per_sample],
        tflops=flops / sum(times) / 1e12,
        mfu_788=flops / sum(times) / (peak.ceiling or peak.flops),
        mfu_989=flops / sum(times) / 989e12,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
        samples=samples,
        clock=clock.summary.text(),
        **clock.summary.to_record(),
    )
    if "packed" not in opts:
        result["phases_gib"] = phase_memory(worker, deliveries[-1], device, dtype)
    if args.detail and "compile" not in opts and "ckpt" not in opts:
        try:
            result["saved_tensors"] = saved_tensor_report(worker, deliveries[-1], device, dtype)
        except Exception as exc:  # noqa: BLE001 - a report, not the measurement
            result["saved_tensors"] = [f"failed: {exc!r}"[:300]]
    if args.trace_steps:
        try:
            tail = deliveries[-args.trace_steps:]
            result["trace"] = (trace_steps(worker, tail, top=args.top) + trace_steps(worker, tail, settle_each=True)
                               + trace_steps(worker, tail))
        except Exception as exc:  # noqa: BLE001 - a report, not the measurement
            result["trace"] = [f"step trace failed: {exc!r}"[:300]]
    if args.detail:
        try:
            result["syncs"] = sync_report(worker, deliveries[-1])
        except Exception as exc:  # noqa: BLE001
            result["syncs"] = [f"sync report failed: {exc!r}"[:300]]
        try:
            result["kernels"], result["kernel_summary"] = kernel_report(worker, deliveries[-1], args.top)
        except Exception as exc:  # noqa: BLE001
            result["kernels"] = [f"failed: {exc!r}"[:300]]
    del worker, deliveries, embed, head
    gc.collect()  # modules and hooks form cycles
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="eager", help="comma-separated variants, each a '+'-joined set of the options above")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per variant (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation; default: %(default)s)")
    parser.add_argument("--max-query-rows", type=int, default=32768, help="block rows per drafter pass (default: %(default)s)")
    parser.add_argument("--detail", action="store_true", help="saved-tensor and kernel reports")
    parser.add_argument("--top", type=int, default=25, help="kernels listed in the reports (0: none; default: %(default)s)")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="also profile this many steps back to back and report each step's busy and idle time")
    parser.add_argument("--out", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--tag", default="", help="a label stored with each variant's result (e.g. the machine or commit)")
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    peak = resolve_peak(device, dtype)
    results = []
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        try:
            res = run_variant(name, args, device, dtype, peak)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            res = {"variant": name, "failed": traceback.format_exc()[-1500:]}
            print(res["failed"])
        res["tag"] = args.tag
        res["total_s"] = time.perf_counter() - t0
        results.append(res)
        for line in res.get("saved_tensors", []) + res.get("trace", []) + res.get("syncs", []) + res.get("kernels", []):
            print(line)
        brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()
                 if k not in ("saved_tensors", "trace", "syncs", "kernels", "kernel_summary")}
        print(json.dumps(brief))
        sys.stdout.flush()
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
