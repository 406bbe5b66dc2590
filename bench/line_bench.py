"""bench_line.py's line mode: `draftline train` colocated on one device, on a random target saved
with save_pretrained and a prepared dataset of random tokens (``line_inputs``, also used by
multi_gpu.py). If preflight refuses the configuration, its refusal and suggestion are recorded and
the line runs again with what it suggests (``--line-retries``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from workloads import random_target, sync, target_config

from draftline.model.drafter import DFlashDrafter


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


def preflight_suggestion(message: str) -> list[str]:
    """The flags preflight's refusal suggests: fewer query rows per pass (same budget, same work) first,
    else a smaller token budget, else fewer queued batches, else activation checkpointing."""
    # Suggested values are written without thousands separators; the configured ones ("32,768") with.
    for pattern, flag in ((r"--max-query-rows (\d+) \(at --token-budget", "--max-query-rows"),
                          (r"--token-budget (\d+)(?!,?\d)", "--token-budget"), (r"--q-hs (\d+)", "--q-hs")):
        found = re.search(pattern, message)
        if found:
            return [flag, found.group(1)]
    return ["--activation-checkpointing"] if "--activation-checkpointing" in message else []


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


def bench_line(args, device, rows, peak, spec_flops: float):
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
        suggested = preflight_suggestion(refusal)
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
    tflops = statistics.median(r["tflops"] for r in last)
    rows.append({"workload": f"{args.shape} line colocated, {args.budget} tok", "role": "target+drafter",
                 "tokens_s": ktok * 1e3, "samples_s": statistics.median(r["samples_s"] for r in last),
                 "tflops": tflops, "mfu": tflops * 1e12 / (peak.ceiling or peak.flops), "mfu_spec": tflops * 1e12 / spec_flops,
                 "reserved_gib": float("nan"), "peak_alloc_gib": peak_alloc,
                 "peak_gib": max((g.get("mem_used_gib") or 0) for r in last for g in r["gpus"]) or float("nan"),
                 "note": f"{' '.join(suggested) or 'defaults'}; steps {train[-1]['step']}, q_hs {last[-1]['q_hs']}, "
                         f"drafter wait {last[-1]['drafter_wait']:.0%}, allocated peak {peak_alloc:.1f} GiB",
                 **extra})
