"""Benchmark the roles of the training line and print one table (docs/FLOPS.md conventions).

    python bench/bench_line.py --shape 8b                 # on a GPU: the Qwen3-8B-shaped workloads
    python bench/bench_line.py --shape tiny --device cpu  # a quick check that the script runs
    python bench/bench_line.py --shape 27b-hybrid --skip target drafter-3072 drafter-packed --line \
        --budget 32768 --line-steps 6 --line-free-target-disk   # the 27B-shaped hybrid line, one H200

Workloads (random bf16 weights built from a config; weights do not matter for speed):
- target:  the frozen target's feature pass over packed batches of log-normal lengths (mean ~2.8K,
  capped at 8K) filling the token budget;
- drafter-3072: one 3,072-token sample with 512 anchors, block 16: forward, backward, AdamW step
  (the SpecForge comparison point, docs/PERF_NOTES.md: 192 ms/sample, 47% MFU on the same H200);
- drafter-packed: a packed batch at the token budget, 512 anchors per document, in passes of
  --max-query-rows rows, with the optimizer step;
- line: (with --line) `draftline train` colocated on one device for --line-steps steps, numbers
  from its metrics.jsonl. If preflight refuses the configuration, its refusal and suggestion are
  reported and the line runs again with what it suggests (``--line-retries``). ``--shape 27b-hybrid``
  is the Qwen3.6-27B-shaped hybrid target (bench_target.py's shapes), all 64 layers saved (~54 GB);
  ``--line-free-target-disk`` deletes the saved weights once the line has loaded them, so that the
  final checkpoint (~26 GB for its drafter and AdamW state) fits beside on a 64 GiB disk.
FLOPs come from draftline.sizing.flops. Two MFU figures: against the GPU's spec dense bf16 peak
(989 TFLOP/s for an H100/H200, the figure the field quotes) and against the measured matmul
ceiling (``resolve_peak``: 788 TFLOP/s on the development H200). Peak memory is per role:
``max_memory_allocated`` after a reset (``max_memory_reserved`` beside it); a drafter row holds one
batch's features at a time, as the drafter role does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from draftline.model.attention import auto_backend
from draftline.model.config import build_drafter_config
from draftline.model.target import TargetFeatures
from draftline.monitor.clocks import ClockWatch
from draftline.sizing.flops import TargetShape, resolve_peak, target_flops
from workloads import (  # noqa: F401  (other scripts imported these from here)
    HYBRID, SHAPES, lognormal_lengths, make_worker, packed_batch, peak_gib, random_target, reserved_gib, reset_peak,
    spec_peak, sync, target_config, train_step,
)
from draftline.pipeline.transport import Delivery

def bench_target(args, device, dtype, peak, rows):
    from draftline.model import linear_attention
    from draftline.model.target import default_attention

    hybrid = linear_attention.is_hybrid(target_config(args.shape))
    model = random_target(args.shape, device, dtype, default_attention(device, hybrid))
    layers = model.config.num_hidden_layers
    drafter_cfg = build_drafter_config(model.config, num_hidden_layers=5, block_size=16)
    ids = drafter_cfg.dflash_config["target_layer_ids"]
    shape = TargetShape.of(model.config)
    target = TargetFeatures.from_model(model, ids)
    rng = np.random.default_rng(0)
    batches = [packed_batch(lognormal_lengths(rng, args.budget), shape.vocab_size, i, i) for i in range(args.iters + 2)]
    variants = ["eager"] if args.no_compile else ["eager", "compiled"]
    for variant in variants:
        if variant == "compiled":
            from draftline.model.fused import compile_target

            compile_target(target)
        t0 = time.perf_counter()
        for b in batches[:2]:  # warm up (compilation, autotuning)
            target(b)
        sync(device)
        warm_s = time.perf_counter() - t0
        reset_peak(device)
        times, flops, tokens, samples = [], 0.0, 0, 0
        with ClockWatch(device) as clock:
            for b in batches[2:]:
                start = time.perf_counter()
                target(b)
                sync(device)
                times.append(time.perf_counter() - start)
                flops += target_flops(shape, b.doc_lengths, max(ids) + 1)
                tokens += b.num_tokens
                samples += b.num_docs
        wall = sum(times)
        rows.append(row(f"{args.shape} target, packed {args.budget} tok, {variant}", "target", tokens / wall,
                        samples / wall, flops / wall, peak, peak_gib(device), reserved=reserved_gib(device),
                        extra=f"ms/batch {', '.join(f'{1e3 * t:.0f}' for t in times)}; warm-up {warm_s:.0f} s; "
                              f"{clock.summary.text()}", clock=clock.summary, step_s=times))
    del target, model
    return drafter_cfg, layers


def bench_drafter(args, cfg, device, dtype, peak, rows, name, make_batches):
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    width = len(cfg.dflash_config["target_layer_ids"]) * hidden
    embed = (torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
    head = (torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
    worker = make_worker(cfg, device, dtype, args.max_query_rows, embed, head, args.head_chunk_rows,
                         compile_layers=not args.no_compile, attention=args.attention)
    batches = make_batches()

    def delivery(b):  # one batch's features at a time, made outside the timed window
        return Delivery(b.index, torch.randn(b.num_tokens, width, device=device, dtype=dtype), b)

    for b in batches[:2]:  # warm up (compilation)
        train_step(worker, delivery(b))
    sync(device)
    reset_peak(device)
    flops_before = worker.counters.flops
    tokens, samples = 0, 0
    # As the drafter role runs: no host sync between steps but the worker's own (one per step: the
    # record of the step before, read after this step's batches were queued), so the host prepares a
    # batch while the GPU still works on the last one. A step's time
    # is then the GPU timeline between the ends of consecutive steps (CUDA events), idle gaps
    # included. --sync-each-step times each step alone between two device syncs (the older protocol).
    pipelined = device.type == "cuda" and not args.sync_each_step

    def mark():  # a point on the GPU's timeline, or on the host's after a device sync
        if not pipelined:
            sync(device)
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    sync(device)
    starts, ends = [], [mark()]
    with ClockWatch(device) as clock:
        for b in batches[2:]:
            d = delivery(b)
            starts.append(ends[-1] if pipelined else mark())  # synced: making the features is left out
            train_step(worker, d)
            ends.append(mark())
            tokens += d.batch.num_tokens
            samples += d.batch.num_docs
            del d
        worker.read_record()  # the last step's record (the loop above read each step's record one step late)
        sync(device)
    times = [a.elapsed_time(b) / 1e3 if pipelined else b - a for a, b in zip(starts, ends[1:])]
    wall = sum(times)
    flops = worker.counters.flops - flops_before
    per_sample = statistics.median(t / b.num_docs for t, b in zip(times, batches[2:]))
    kernel = args.attention if args.attention != "auto" else auto_backend(device, cfg)
    steps = ", ".join(f"{1e3 * t:.0f}" for t in times)
    rows.append(row(name, "drafter", tokens / wall, samples / wall, flops / wall, peak, peak_gib(device),
                    extra=f"{1000 * wall / samples:.0f} ms/sample (median {1000 * per_sample:.0f}); attention {kernel}; "
                          f"steps ms {steps}; {clock.summary.text()}",
                    reserved=reserved_gib(device), clock=clock.summary, step_s=times))
    del worker, embed, head


SPEC = {"flops": float("nan")}  # set in main() from the device name


def row(workload, role, tok_s, samples_s, flops_s, peak, mem, extra="", reserved=float("nan"), clock=None, step_s=None):
    record = {"workload": workload, "role": role, "tokens_s": tok_s, "samples_s": samples_s,
              "tflops": flops_s / 1e12, "mfu": flops_s / (peak.ceiling or peak.flops), "mfu_spec": flops_s / SPEC["flops"],
              "peak_gib": mem, "reserved_gib": reserved, "note": extra}
    if step_s is not None:
        record["step_ms"] = [round(1e3 * t, 2) for t in step_s]
    if clock is not None:
        record.update(clock.to_record())
    return record


def print_table(rows, peak, out: Path | None):
    header = (f"{'workload':40s} {'role':15s} {'tok/s':>10s} {'samples/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} "
              f"{'MFU@ceil':>8s} {'peak GiB':>8s} {'reserved':>8s}  note")
    print(f"\nMFU against the spec dense bf16 peak ({SPEC['flops'] / 1e12:.0f} TFLOP/s); "
          f"MFU@ceil against the measured ceiling, {peak.describe()}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "tokens_s" not in r:
            print(f"{r['workload']:40s} {r['role']:15s} {r['note']}")
            continue
        print(f"{r['workload']:40s} {r['role']:15s} {r['tokens_s']:10.0f} {r['samples_s']:9.2f} {r['tflops']:8.1f} "
              f"{100 * r['mfu_spec']:5.1f}% {100 * r['mfu']:7.1f}% {r['peak_gib']:8.1f} {r['reserved_gib']:8.1f}  "
              f"{r['note']}")
    if out:
        out.write_text(json.dumps({"peak": peak.flops, "peak_source": peak.source, "spec_peak": SPEC["flops"],
                                   "rows": rows}, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(HYBRID), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=int, default=49152)
    parser.add_argument("--max-query-rows", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--head-chunk-rows", type=int, default=2048, help="rows of logits per LM-head chunk")
    parser.add_argument("--no-compile", action="store_true", help="drafter and target layers eager (no torch.compile)")
    parser.add_argument("--attention", default="auto", choices=["auto", "flex", "flash", "dense"],
                        help="the drafter's attention ('flash': flex on FlashAttention-4's kernels)")
    parser.add_argument("--flex-options", type=json.loads, default=None,
                        help="JSON kernel options for flex's Triton kernels (e.g. block sizes), to compare with the default")
    parser.add_argument("--sync-each-step", action="store_true",
                        help="time each drafter step alone between device syncs (default: steps back to back, as trained)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["target", "drafter-3072", "drafter-packed"])
    parser.add_argument("--line", action="store_true", help="also run `draftline train` colocated")
    parser.add_argument("--line-steps", type=int, default=40)
    parser.add_argument("--line-samples", type=int, default=1500)
    parser.add_argument("--line-log-every", type=float, default=10.0, help="seconds between the line's metrics records")
    parser.add_argument("--line-retries", type=int, default=1, help="runs again with what a preflight refusal suggests")
    parser.add_argument("--line-free-target-disk", action="store_true",
                        help="delete the saved target weights once the line has loaded them (disk for the checkpoint)")
    parser.add_argument("--workdir", help="where --line keeps its target and data (reused if present)")
    parser.add_argument("--line-args", default="", help="more `draftline train` flags for --line, e.g. '--gpu-memory-gib 96'")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    if args.flex_options:
        from draftline.model import attention

        attention.FLEX_KERNELS["flex"] = args.flex_options
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = resolve_peak(device, dtype)
    SPEC["flops"] = spec_peak(device)
    rows: list[dict] = []
    cfg = build_drafter_config(target_config(args.shape), num_hidden_layers=5, block_size=16)
    drafter = f"{args.shape} drafter" + ("" if args.attention == "auto" else f" ({args.attention})")
    drafter += " (tuned flex)" if args.flex_options else ""
    drafter += " (synced steps)" if args.sync_each_step else ""
    steps = [
        ("target", lambda: bench_target(args, device, dtype, peak, rows)),
        ("drafter-3072", lambda: bench_drafter(
            args, cfg, device, dtype, peak, rows, f"{drafter}, 1 x 3072 tok, 512 anchors",
            lambda: [packed_batch([3072], cfg.vocab_size, i, i) for i in range(args.iters + 2)])),
        ("drafter-packed", lambda: bench_drafter(
            args, cfg, device, dtype, peak, rows, f"{drafter}, packed {args.budget} tok",
            lambda: [packed_batch(lognormal_lengths(np.random.default_rng(i), args.budget), cfg.vocab_size, i, i)
                     for i in range(args.iters + 2)])),
    ]
    for name, fn in steps:
        if name in args.skip:
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing workload must not hide the others
            rows.append({"workload": name, "role": "-", "note": f"failed: {type(exc).__name__}: {str(exc)[:200]}"})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print_table(rows, peak, None)
        sys.stdout.flush()
    if args.line:
        try:
            from line_bench import bench_line  # the line mode's own module (it imports this one)

            bench_line(args, device, rows, peak, SPEC["flops"])
        except Exception as exc:  # noqa: BLE001
            rows.append({"workload": "line", "role": "-", "note": f"failed: {type(exc).__name__}: {str(exc)[:200]}"})
    print_table(rows, peak, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
