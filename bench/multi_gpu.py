"""The disaggregated line on several GPUs of one host: every target/drafter split, and failures.

    python bench/multi_gpu.py splits --shape 8b --gpus 2            # every split of 2 GPUs (+ colocated on 1)
    python bench/multi_gpu.py failures --shape 8b --gpus 2          # kill a drafter, kill a target, resume
    python bench/multi_gpu.py both --shape tiny --gpus 2 --device cpu --budget 2048 --max-anchors 8  # the same code on CPU ranks (gloo)

`splits` runs `draftline train --gpus N --targets T` for T = 1..N-1, `--gpus N --colocated` (a
target and a drafter on every GPU, data-parallel drafters), and the one-GPU colocated line as the
per-GPU baseline, on a random target saved with save_pretrained and random packed data
(bench_line.line_inputs), and prints one table from each run's metrics.jsonl (steady state: tokens
trained over the second half of the logged intervals): Ktok/s, Ktok/s per GPU against colocated, MFU, queue
depths, waits per side, memory per GPU, and the hidden-state transfer (GB/s of the sends and the
share of the wall time the link was busy).

`failures` starts a run, SIGKILLs one rank after a checkpoint, checks that the run stops with an
error that names the rank and writes failure.json, then resumes from the checkpoint and checks
that training continues from the step after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_line import line_inputs  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_args(work: Path, out: Path, args, gpus: int, targets: int | None, steps: int, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "draftline", "train", "--target", str(work / "target"), "--data", str(work / "data"),
            "--out", str(out), "--token-budget", str(args.budget), "--max-steps", str(steps), "--epochs", "1",
            "--log-every", "5", "--save-every-minutes", "0", "--no-tensorboard", "--device", args.device,
            "--gpus", str(gpus), *extra]
    if args.max_anchors:
        argv += ["--max-anchors", str(args.max_anchors)]
    if targets is not None:
        argv += ["--targets", str(targets)]
    return argv


def summarize(out: Path, gpus: int, name: str) -> dict:
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train" and r.get("ktok_s")]
    if not train:
        return {"split": name, "note": "no train records"}
    last = train[len(train) // 2:]
    med = lambda key: statistics.median(r[key] for r in last)  # noqa: E731
    end = last[-1]
    # Steady state from the cumulative token count over the second half (the monitor's 30 s rate
    # window still holds warm-up time in short runs); FLOPs per token from the logged rates.
    first = train[len(train) // 2 - 1] if len(train) > 1 else last[0]
    span = end["elapsed_s"] - first["elapsed_s"]
    ktok_s = (end["tokens"] - first["tokens"]) / span / 1e3 if span > 0 and end["tokens"] > first["tokens"] else med("ktok_s")
    tflops = ktok_s * statistics.median(r["tflops"] / r["ktok_s"] for r in last)
    ratios = [r["mfu"] / r["tflops"] for r in last if r["tflops"] and r.get("mfu") is not None]  # no MFU on CPU
    mfu_value = tflops * statistics.median(ratios) if ratios else float("nan")
    mem: dict[int, float] = {}
    for r in last:
        for g in r.get("gpus", []):
            if g.get("mem_used_gib") is not None:
                mem[g["rank"]] = max(mem.get(g["rank"], 0.0), g["mem_used_gib"])
    roles = {g["rank"]: g["role"][0] for g in end.get("gpus", [])}
    transfer = end.get("transfer") or {}
    busy = None
    if transfer.get("send_s") and end.get("elapsed_s"):
        num_targets = sum(1 for role in roles.values() if role == "t") or 1
        busy = transfer["send_s"] / (end["elapsed_s"] * num_targets)
    return {
        "split": name, "gpus": gpus, "ktok_s": ktok_s, "per_gpu": ktok_s / gpus, "mfu": mfu_value,
        "tflops": tflops, "monitor_ktok_s": med("ktok_s"), "steady_s": round(span, 1), "q_pre": end.get("q_pre"), "q_hs": end.get("q_hs"),
        "target_wait": med("target_wait"), "drafter_wait": med("drafter_wait"),
        "mem_gib": {f"{r}{roles.get(r, '?')}": round(v, 1) for r, v in sorted(mem.items())},
        "transfer_gb_s": transfer.get("gb_s"), "link_busy": busy, "sent_gb": transfer.get("sent_gb"),
    }


def run_splits(args, work: Path) -> list[dict]:
    results = []
    layouts = [(1, None, "colocated")] if not args.no_colocated else []
    layouts += [(args.gpus, t, f"{t}t+{args.gpus - t}d") for t in range(1, args.gpus)]
    layouts += [(args.gpus, "colocated", f"{args.gpus}x colocated")]
    if args.layouts:
        wanted = set(args.layouts.split(","))
        layouts = [layout for layout in layouts if layout[2] in wanted]
    for gpus, targets, name in layouts:
        out = work / f"run-{name.replace(' ', '-')}"
        extra = ["--colocated"] if targets == "colocated" else []
        argv = train_args(work, out, args, gpus, None if extra else targets, args.steps, "--from-scratch",
                          "--save-every", "100000", "--q-hs", str(args.q_hs), *extra, *args.extra)
        print(f"\n=== {name}: {' '.join(argv[2:])}", flush=True)
        start = time.time()
        code = run_to_end(argv, args.timeout)
        row = summarize(out, gpus, name)
        row.update(exit=code, wall_s=round(time.time() - start))
        results.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in results if r["split"] == "colocated" and "per_gpu" in r), None)
    print(f"\n{args.shape}, token budget {args.budget}, {args.steps} steps per run (steady state: second half)")
    print(f"{'split':12s} {'Ktok/s':>7s} {'/GPU':>6s} {'vs colo':>7s} {'MFU':>6s} {'t wait':>6s} {'d wait':>6s} "
          f"{'q_hs':>4s} {'GB/s':>6s} {'link':>5s}  memory GiB per rank")
    for r in results:
        if "per_gpu" not in r:
            print(f"{r['split']:12s} failed: exit {r.get('exit')} {r.get('note', '')}")
            continue
        rel = f"{r['per_gpu'] / base['per_gpu']:.0%}" if base else "-"
        gbs = f"{r['transfer_gb_s']:.1f}" if r.get("transfer_gb_s") else "-"
        busy = f"{r['link_busy']:.1%}" if r.get("link_busy") is not None else "-"
        print(f"{r['split']:12s} {r['ktok_s']:7.2f} {r['per_gpu']:6.2f} {rel:>7s} {r['mfu']:6.1%} "
              f"{r['target_wait']:6.0%} {r['drafter_wait']:6.0%} {str(r['q_hs']):>4s} {gbs:>6s} {busy:>5s}  {r['mem_gib']}")
    return results


def run_to_end(argv: list[str], timeout: float) -> int | str:
    """Run a launcher; on timeout kill its whole process group (the ranks hold GPU memory)."""
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(5)  # let the driver release the ranks' memory before the next run
        return "timeout"


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before {what}")
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


def run_failure(args, work: Path, victim: int, role: str, targets: int) -> dict:
    """Kill rank ``victim`` after the first checkpoint; check the message, then resume."""
    from draftline.checkpoint.state import latest_checkpoint

    out = work / f"fail-{role}"
    common = ["--save-every", "3", "--trace", "--q-hs", str(args.q_hs), "--failure-timeout", "30"]
    argv = train_args(work, out, args, args.gpus, targets, 1000, "--from-scratch", *common)
    print(f"\n=== kill {role} rank {victim}: {' '.join(argv[2:])}", flush=True)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    result: dict = {"victim": f"{role} rank {victim}"}
    try:
        _wait(lambda: latest_checkpoint(out) is not None and len(read_jsonl(out / "trace" / "steps.jsonl")) >= 5,
              args.timeout, "a checkpoint and 5 steps", proc)
        pid = json.loads((out / "ranks" / f"rank-{victim}.json").read_text())["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    except BaseException:
        proc.kill()
        raise
    result["stopped_after_s"] = round(time.time() - killed_at, 1)
    result["exit"] = proc.returncode
    named = [line for line in err.splitlines() if f"rank {victim}" in line]
    result["message"] = named[0][:300] if named else err[-600:]
    result["named"] = bool(named) and f"pid {pid}" in err
    failure = out / "failure.json"
    result["failure_json"] = json.loads(failure.read_text())["message"][:300] if failure.is_file() else None
    checkpoint = latest_checkpoint(out)
    result["checkpoint"] = checkpoint.name if checkpoint else None
    if checkpoint is None:
        return result
    step = int(checkpoint.name.split("-")[-1])
    resume = train_args(work, out, args, args.gpus, targets, step + 3, "--resume", "--save-every", "1000",
                        "--q-hs", str(args.q_hs), "--trace")
    print(f"--- resume: {' '.join(resume[2:])}", flush=True)
    done = subprocess.run(resume, timeout=args.timeout, capture_output=True, text=True)
    steps = [r["step"] for r in read_jsonl(out / "trace" / "steps.jsonl") if "step" in r]
    starts = read_jsonl(out / "starts.jsonl")
    result["resume_exit"] = done.returncode
    result["resume_mode"] = starts[-1].get("mode") if starts else None
    result["resumed_steps"] = [s for s in steps if s > step][-3:]
    if done.returncode != 0:
        result["resume_error"] = done.stderr[-600:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["splits", "failures", "both"], help="what to run (above)")
    parser.add_argument("--shape", default="8b", help="the target's shape, as bench_line.py names them (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 3,
                        help="GPUs (or CPU ranks) to split (default: every visible GPU, 3 without CUDA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, or cpu for CPU ranks over gloo (default: cuda when present)")
    parser.add_argument("--budget", type=int, default=32768, help="train's --token-budget (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per layout in splits (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=600, help="random samples in the dataset (default: %(default)s)")
    parser.add_argument("--q-hs", type=int, default=4, help="train's --q-hs, batches of features queued (default: %(default)s)")
    parser.add_argument("--max-anchors", type=int, help="per document (default: the trainer's); small on CPU")
    parser.add_argument("--timeout", type=float, default=400,
                        help="seconds one run may take before its process group is killed (default: %(default)s)")
    parser.add_argument("--no-colocated", action="store_true", help="skip the one-GPU baseline")
    parser.add_argument("--workdir", help="keeps the random target and data (reused if present)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--layouts", help="only these, comma-separated: colocated, 1t+1d, ..., '2x colocated'")
    parser.add_argument("--victims", help="failures: only these roles, comma-separated (drafter,target)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `draftline train` flags, last")
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("needs at least 2 GPUs (or --device cpu with --gpus >= 2)")
    work, _ = line_inputs(args.shape, args.budget, args.samples, args.workdir, torch.device(args.device))
    results: dict = {"shape": args.shape, "gpus": args.gpus, "budget": args.budget}
    if args.mode in ("splits", "both"):
        results["splits"] = run_splits(args, work)
    if args.mode in ("failures", "both"):
        # Ranks 0.. are drafters (rank 0 logs), targets follow: kill the last drafter and the last target.
        results["failures"] = []
        for victim, role in [(0, "drafter"), (args.gpus - 1, "target")]:
            if args.victims and role not in args.victims.split(","):
                continue
            try:
                results["failures"].append(run_failure(args, work, victim, role, 1))
            except Exception as exc:  # noqa: BLE001 - recorded, the next case still runs
                results["failures"].append({"victim": f"{role} rank {victim}", "error": repr(exc)})
            print(json.dumps(results["failures"][-1], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
