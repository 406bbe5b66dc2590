"""The roles of the training line on one device, and the line itself: one table (docs/FLOPS.md conventions).

    python bench/bench_line.py --shape 8b --budget 32768 --line  # on a GPU: the 8B rows of the README's table
    python bench/bench_line.py --shape tiny --device cpu --iters 2 --budget 2048 --skip drafter-3072 \
        --no-compile --line --line-steps 3 --line-samples 40 --line-args="--target-layer-ids 1,2,3,4"
                                                                  # a quick check that the script runs (CPU, minutes)
    python bench/bench_line.py --shape 27b-hybrid --skip target drafter-3072 drafter-packed --line \
        --budget 16384 --max-query-rows 8192 --line-steps 10 --line-samples 120 --line-free-target-disk \
        --line-args="--gpu-memory-gib 94.97"                      # the 27B-shaped hybrid line, one H200

Workloads (random weights built from a config; weights do not matter for speed), each skippable with --skip:
- target: the frozen target's feature pass over packed batches of log-normal lengths (mean ~2.8K,
  capped at 8K) filling the token budget, eager and then compiled (``--target-modes``; ``--no-compile``: eager
  only), and with ``--target-fp8`` again with its linear layers in FP8 (the same weights' seed and batches);
  with a hybrid shape (27b-hybrid, tiny-hybrid) on a GPU it needs flash-linear-attention;
- drafter-3072: one 3,072-token sample with 512 anchors, block 16: forward, backward, AdamW step
  (the comparison point with SpecForge's own step, docs/benchmarks/2026-12-drafter-step.md);
- drafter-packed: a packed batch at the token budget, 512 anchors per document, in passes of
  --max-query-rows rows, with the optimizer step;
- line (with --line): `draftline train` colocated on one device for --line-steps steps, numbers
  from its metrics.jsonl (steady state: the monitor's medians over the second half of its records, and
  the rate over that half counted from the records' token totals).
  If preflight refuses the configuration, its refusal and suggestion are reported and the line runs
  again with what it suggests (``--line-retries``). The 27b-hybrid target is saved whole (~54 GB);
  ``--line-free-target-disk`` deletes the saved weights once the line has loaded them, so that the
  final checkpoint (~26 GB for its drafter and AdamW state) fits beside it on a 64 GiB disk.
Drafter steps run back to back as the drafter role trains them (each step's record read one step
late); a step's time is the GPU timeline between the ends of consecutive steps (CUDA events).
FLOPs come from the package's FLOP counter. Two MFU figures: against the GPU's spec dense bf16 peak
(989 TFLOP/s for an H100/H200, the figure the field quotes) and against the measured matmul
ceiling (788 TFLOP/s on the H200 of docs/benchmarks/). Peak memory is per row:
``max_memory_allocated`` after a reset (``max_memory_reserved`` beside it); a drafter row holds one
batch's features at a time, as the drafter role does. Each row also carries the GPU's SM clock, power
and what NVML says held the clock back over the timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from workloads import (  # bench/ is on sys.path when run as a script
    HYBRID, SHAPES, lognormal_lengths, make_worker, packed_batch, peak_gib, random_target, reserved_gib, reset_peak,
    spec_peak, sync, target_config, train_step,
)

from draftline.model.attention import auto_backend
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import TargetFeatures
from draftline.monitor.clocks import ClockWatch
from draftline.sizing.preflight import suggested_flags
from draftline.sizing.flops import TargetShape, resolve_peak, target_flops
from draftline.pipeline.transport import Delivery

_START = time.perf_counter()


def say(workload: str, text: str) -> None:
    """A progress line on stderr, with the seconds since the script started: a run cut short by a time limit
    still tells how far each workload got (the table is printed only when a workload ends)."""
    print(f"[{time.perf_counter() - _START:6.0f} s] {workload}: {text}", file=sys.stderr, flush=True)


def bench_target(args, device, dtype, peak, rows):
    from draftline.model import linear_attention
    from draftline.model.target import default_attention

    hybrid = linear_attention.is_hybrid(target_config(args.shape))
    drafter_cfg = build_drafter_config(target_config(args.shape), num_hidden_layers=5, block_size=16)
    ids = drafter_cfg.dflash_config["target_layer_ids"]
    shape = TargetShape.of(target_config(args.shape))
    rng = np.random.default_rng(0)
    batches = [packed_batch(lognormal_lengths(rng, args.budget), shape.vocab_size, i, i) for i in range(args.iters + 2)]
    modes = ["eager"] if args.no_compile else args.target_modes.split(",")
    for fp8 in [False, True] if args.target_fp8 else [False]:
        torch.manual_seed(0)  # the same weights in bf16 and in FP8
        model = random_target(args.shape, device, dtype, default_attention(device, hybrid))
        say("target", f"{args.shape} built" + (", its linear layers in FP8" if fp8 else ""))
        target = TargetFeatures.from_model(model, ids, fp8=fp8)
        for mode in modes:
            variant = f"{mode}, FP8" if fp8 else mode
            if mode == "compiled":
                from draftline.model.fused import compile_target

                compile_target(target)
            t0 = time.perf_counter()
            for b in batches[:2]:  # warm up (compilation, autotuning)
                target(b)
            sync(device)
            warm_s = time.perf_counter() - t0
            say("target", f"{variant}: warmed up in {warm_s:.0f} s; timing {len(batches) - 2} batches")
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
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return drafter_cfg, shape.num_layers


def bench_drafter(args, cfg, device, dtype, peak, rows, name, make_batches):
    say(name, "building the drafter")
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    width = len(cfg.dflash_config["target_layer_ids"]) * hidden
    embed = (torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
    head = (torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
    worker = make_worker(cfg, device, dtype, args.max_query_rows, embed, head, args.head_chunk_rows,
                         compile_layers=not args.no_compile, attention=args.attention)
    batches = make_batches()

    def delivery(b):  # one batch's features at a time, made outside the timed window
        return Delivery(b.index, torch.randn(b.num_tokens, width, device=device, dtype=dtype), b)

    for i, b in enumerate(batches[:2]):  # warm up (compilation)
        say(name, f"warm-up step {i + 1} of 2 ({b.num_tokens} tokens)")
        train_step(worker, delivery(b))
    sync(device)
    say(name, f"warmed up; timing {len(batches) - 2} steps")
    reset_peak(device)
    tokens, samples, step_flops = 0, 0, []
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
            counted = worker.counters.flops
            train_step(worker, d)
            step_flops.append(worker.counters.flops - counted)
            ends.append(mark())
            tokens += d.batch.num_tokens
            samples += d.batch.num_docs
            del d
        worker.read_record()  # the last step's record (the loop above read each step's record one step late)
        sync(device)
    times = [a.elapsed_time(b) / 1e3 if pipelined else b - a for a, b in zip(starts, ends[1:])]
    wall = sum(times)
    flops = sum(step_flops)
    per_sample = statistics.median(t / b.num_docs for t, b in zip(times, batches[2:]))
    kernel = args.attention if args.attention != "auto" else auto_backend(device, cfg)
    steps = ", ".join(f"{1e3 * t:.0f}" for t in times)
    # Each step's MFU of the spec peak: a step that compiled again (a new shape) stands out from the steady ones.
    step_mfu = [f / t / SPEC["flops"] for f, t in zip(step_flops, times)]
    mfus = ", ".join(f"{100 * m:.1f}" for m in step_mfu)
    record = row(name, "drafter", tokens / wall, samples / wall, flops / wall, peak, peak_gib(device),
                 extra=f"{1000 * wall / samples:.0f} ms/sample (median {1000 * per_sample:.0f}); attention {kernel}; "
                       f"steps ms {steps}; steps' MFU % {mfus} (median {100 * statistics.median(step_mfu):.1f}); "
                       f"{clock.summary.text()}",
                 reserved=reserved_gib(device), clock=clock.summary, step_s=times)
    record["step_tflop"] = [round(f / 1e12, 3) for f in step_flops]
    record["step_mfu_spec"] = [round(m, 4) for m in step_mfu]
    rows.append(record)
    del worker, embed, head


# --------------------------------------------------------------------------------------------------
# The line (--line): `draftline train` colocated on one device, on a random target saved with
# save_pretrained and a prepared dataset of random tokens (``line_inputs``, also used by multi_gpu.py).


def _weights(target_dir: Path) -> list[Path]:
    return sorted(p for p in target_dir.glob("*") if p.name.endswith((".safetensors", ".safetensors.index.json")))


def line_inputs(shape: str, budget: int, samples: int, workdir: str | None, device: torch.device,
                reserve_bytes: int = 0) -> tuple[Path, dict]:
    """A random target (saved with save_pretrained) and a prepared dataset of random tokens, in a
    work folder (reused if already there). Refuses before writing when the disk cannot also hold
    ``reserve_bytes`` (what the run itself will write). Returns the folder and timings."""
    from draftline.data.dataset import DatasetWriter

    work = Path(workdir or tempfile.mkdtemp(prefix="draftline-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    target_dir = work / "target"
    info: dict = {}
    if not ((target_dir / "config.json").is_file() and _weights(target_dir)):
        start = time.perf_counter()
        model = random_target(shape, device, torch.bfloat16, "sdpa")
        sync(device)
        info["build_s"] = time.perf_counter() - start
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        free = shutil.disk_usage(work).free
        info.update(target_bytes=size, disk_free_bytes=free)
        print(f"line: random {shape} target built on {device} in {info['build_s']:.0f} s: {size / 1e9:.1f} GB of "
              f"weights to write, {free / 1e9:.1f} GB free in {work}", flush=True)
        if size + reserve_bytes > free:
            raise SystemExit(f"line: {work} has {free / 1e9:.1f} GB free, the target needs {size / 1e9:.1f} GB and "
                             f"the run {reserve_bytes / 1e9:.1f} GB more: pass --workdir on a larger disk"
                             + ("" if reserve_bytes == 0 else " (or --line-free-target-disk)"))
        start = time.perf_counter()
        model.save_pretrained(target_dir, max_shard_size="5GB")  # one shard at a time in host memory
        info["save_s"] = time.perf_counter() - start
        print(f"line: saved with save_pretrained in {info['save_s']:.0f} s ({size / 1e9 / info['save_s']:.2f} GB/s)",
              flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    data_dir = work / "data"
    if not (data_dir / "meta.json").is_file():
        rng = np.random.default_rng(1)
        vocab = target_config(shape).vocab_size
        writer = DatasetWriter(data_dir, vocab)
        for _ in range(samples):
            n = int(min(8192, budget, max(64, rng.lognormal(math.log(2826) - 0.18, 0.6))))
            ids = rng.integers(0, vocab - 1, n)
            mask = np.arange(n) >= n // 5
            writer.add(ids, mask, [n])
        writer.finish({"target_vocab_size": vocab, "source": "bench"})
    return work, info


class _Tee(io.TextIOBase):
    """stderr as it is, and a copy (preflight's refusal is printed there)."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.stream.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()


def _when_started(metrics: Path, action, stop: threading.Event) -> threading.Thread:
    """Run ``action`` once the run logs its start record (target loaded, preflight passed)."""
    def watch():
        while not stop.wait(0.5):
            try:
                lines = metrics.read_text().splitlines()
            except OSError:
                continue
            if any(line.startswith("{") and '"kind": "start"' in line for line in lines):  # the logger's json.dumps
                action()
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _drafter_checkpoint_bytes(shape: str) -> int:
    """Disk for the final checkpoint and export: fp32 weights twice (drafter/ and state/), the AdamW state, a bf16
    copy (18 B/parameter)."""
    from draftline.model.config import build_drafter_config

    with torch.device("meta"):
        drafter = DFlashDrafter(build_drafter_config(target_config(shape)))
    return 18 * sum(p.numel() for p in drafter.parameters())


def run_line(args, device, rows, peak, spec_flops: float):
    """`draftline train` colocated, on a random target saved with save_pretrained."""
    from draftline.cli import main

    reserve = 0 if args.line_free_target_disk else _drafter_checkpoint_bytes(args.shape)
    work, info = line_inputs(args.shape, args.budget, args.line_samples, args.workdir, device, reserve)
    target_dir, data_dir = work / "target", work / "data"
    base = ["train", "--target", str(target_dir), "--data", str(data_dir), "--from-scratch",
            "--token-budget", str(args.budget), "--max-steps", str(args.line_steps), "--epochs", "1",
            "--log-every", str(args.line_log_every), "--save-every", "100000", "--save-every-minutes", "0",
            "--no-tensorboard", "--q-hs", "2", "--max-query-rows", str(args.max_query_rows)] + (
                ["--no-compile"] if args.no_compile else []) + args.line_args.split()
    attempts, suggested = [], []
    for attempt in range(1 + args.line_retries):
        out = work / f"run-{attempt}"
        argv = base + ["--out", str(out)] + suggested
        stop = threading.Event()

        def started():
            if device.type == "cuda":  # from here on the peak is the training's, not preflight's
                torch.cuda.reset_peak_memory_stats(device)
            if args.line_free_target_disk:
                files = _weights(target_dir)
                size = sum(f.stat().st_size for f in files)
                for f in files:
                    f.unlink()
                print(f"line: target loaded; deleted its {len(files)} weight files ({size / 1e9:.1f} GB) for the "
                      "final checkpoint's room", flush=True)

        _when_started(out / "metrics.jsonl", started, stop)
        tee = _Tee(sys.stderr)
        start = time.perf_counter()
        print(f"line: attempt {attempt + 1}: draftline {' '.join(argv)}", flush=True)
        try:
            with contextlib.redirect_stderr(tee):
                code = main(argv)
        finally:
            stop.set()
        gc.collect()  # a refused attempt's target and drafter must be gone before the next one loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
        refusal = next((line for line in tee.copy.getvalue().splitlines() if "preflight: the " in line), None)
        record = {"argv": argv[1:], "exit": code, "seconds": time.perf_counter() - start, "refusal": refusal,
                  "allocated_after_gib": torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None}
        preflight_file = out / "preflight" / "rank-0.json"
        if preflight_file.is_file():  # what preflight measured and allowed, per role (sizing/preflight.py)
            record["preflight"] = {
                role: {"peak_gib": round(v["peak_bytes"] / 2**30, 1), "limit_gib": round(
                    (min(v["total"] * v["fraction"], v["free"] + v["reserved"]) - v["headroom"]) / 2**30, 1)}
                for role, v in json.loads(preflight_file.read_text()).items()}
        attempts.append(record)
        print(f"line: attempt {attempt + 1}: exit {code} in {record['seconds']:.0f} s"
              + (f"; preflight refused: {refusal}" if refusal else "")
              + (f"; preflight {record['preflight']}" if "preflight" in record else ""), flush=True)
        if code == 0 or not refusal:
            break
        suggested = suggested_flags(refusal)
        if not suggested:
            break
        print(f"line: preflight suggests {' '.join(suggested)}; running again with it", flush=True)
    peak_alloc = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    extra = {"attempts": attempts, **info}
    records = []
    if (out / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train" and r.get("ktok_s")]
    if code != 0 or not train:
        rows.append({"workload": "line colocated", "role": "both", "note": f"failed (exit {code})", **extra})
        return
    last = train[len(train) // 2 :]  # steady state: the second half of the intervals
    ktok = statistics.median(r["ktok_s"] for r in last)
    # The same span counted from the records' token totals: independent of the monitor's windows.
    span_s = last[-1]["time"] - last[0]["time"]
    counted = (last[-1]["tokens"] - last[0]["tokens"]) / span_s if len(last) > 1 and span_s > 0 else float("nan")
    tflops = statistics.median(r["tflops"] for r in last)
    rows.append({"workload": f"{args.shape} line colocated, {args.budget} tok", "role": "target+drafter",
                 "tokens_s": ktok * 1e3, "samples_s": statistics.median(r["samples_s"] for r in last),
                 "tflops": tflops, "mfu": tflops * 1e12 / (peak.ceiling or peak.flops), "mfu_spec": tflops * 1e12 / spec_flops,
                 "reserved_gib": float("nan"), "peak_alloc_gib": peak_alloc,
                 "peak_gib": max((g.get("mem_used_gib") or 0 for r in last for g in r.get("gpus") or []), default=0) or float("nan"),
                 "tokens_s_counted": counted,
                 "note": f"{' '.join(suggested) or 'defaults'}; steps {train[-1]['step']}, q_hs {last[-1]['q_hs']}, "
                         f"drafter wait {last[-1]['drafter_wait']:.0%}, allocated peak {peak_alloc:.1f} GiB; "
                         f"steps {last[0]['step']}-{last[-1]['step']} by their token counts {counted / 1e3:.2f} Ktok/s",
                 **extra})


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(HYBRID), default="8b",
                        help="the target's shape (Qwen3 8B/32B/1.7B, the Qwen3.6-27B hybrid, or tiny ones for a check); "
                             "the drafter is the default 5-layer one for it, block 16 (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda when present; on CPU fp32 and no MFU)")
    parser.add_argument("--budget", type=int, default=49152,
                        help="tokens per packed batch: the target row, the packed drafter row and the line's "
                             "--token-budget (default: %(default)s)")
    parser.add_argument("--max-query-rows", type=int, default=32768,
                        help="block rows per drafter pass (the line's --max-query-rows; default: %(default)s)")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed batches per row, after 2 warm-up batches (default: %(default)s)")
    parser.add_argument("--head-chunk-rows", type=int, default=2048,
                        help="rows of logits per LM-head chunk in the drafter rows (default: %(default)s; "
                             "train's default is 4096: 1.4-1.8 GiB more on the 8B drafter, not clearly faster)")
    parser.add_argument("--target-modes", default="eager,compiled",
                        help="the target row's passes, comma-separated: eager, compiled (default: %(default)s; "
                             "--no-compile: eager)")
    parser.add_argument("--target-fp8", action="store_true",
                        help="the target row again with its linear layers in FP8 (train's --target-fp8), same batches; "
                             "the MFU stays counted against the bf16 peak")
    parser.add_argument("--no-compile", action="store_true",
                        help="drafter and target layers eager (no torch.compile), in the rows and the line")
    parser.add_argument("--attention", default="auto", choices=["auto", "flex", "flash", "dense"],
                        help="the drafter's attention: auto (FlashAttention-4 where installed and it passes its check, "
                             "else flex), flex (Triton kernels), flash (flex on FlashAttention-4's kernels), dense")
    parser.add_argument("--flex-options", type=json.loads, default=None,
                        help="JSON kernel options for flex's Triton kernels (e.g. block sizes), to compare with the default")
    parser.add_argument("--sync-each-step", action="store_true",
                        help="time each drafter step alone between device syncs (default: steps back to back, as trained)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["target", "drafter-3072", "drafter-packed"],
                        help="rows to leave out")
    parser.add_argument("--line", action="store_true", help="also run `draftline train` colocated (the line row)")
    parser.add_argument("--line-steps", type=int, default=40, help="the line's --max-steps (default: %(default)s)")
    parser.add_argument("--line-samples", type=int, default=1500,
                        help="random samples in the line's dataset (one epoch must hold --line-steps; default: %(default)s)")
    parser.add_argument("--line-log-every", type=float, default=10.0, help="seconds between the line's metrics records")
    parser.add_argument("--line-retries", type=int, default=1,
                        help="times to run the line again with what a preflight refusal suggests (default: %(default)s)")
    parser.add_argument("--line-free-target-disk", action="store_true",
                        help="delete the saved target weights once the line has loaded them (disk for the checkpoint)")
    parser.add_argument("--workdir", help="where --line keeps its target and data (reused if present; default: a new "
                                          "temporary folder)")
    parser.add_argument("--line-args", default="", help="more `draftline train` flags for --line, given with '=': --line-args='--gpu-memory-gib 94.97'")
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
            run_line(args, device, rows, peak, SPEC["flops"])
        except Exception as exc:  # noqa: BLE001
            rows.append({"workload": "line", "role": "-", "note": f"failed: {type(exc).__name__}: {str(exc)[:200]}"})
    print_table(rows, peak, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
