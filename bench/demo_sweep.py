"""Try training settings on the demo's data, several at once, and print one table of acceptance.

    python bench/demo_sweep.py --out sweep --quick --parallel 5 \
        --variant base= --variant distill=--distill=1.0 --variant "d8=--distill=1.0 --epochs=8"

Stages 1-3 of the demo (conversations, the tiny target's replies, the packed dataset) run once;
then every variant runs the demo's ``draftline train`` (2 target ranks + 1 drafter rank, gloo) with
its extra flags appended (a repeated flag overrides the demo's), and ``draftline eval`` on the
held-out prompts. Variants run ``--parallel`` at a time, each with ``--threads`` threads per process;
on a machine with many cores this measures in one pass what the 2-core demo takes an hour for.
Time columns are wall time on THIS machine, shared by the parallel runs: compare them with each
other, not with the demo's minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from draftline.demo.pipeline import DemoConfig, Stages, eval_args, make_data, train_args


def _run(args: list[str], log: Path, env: dict) -> float:
    start = time.time()
    with open(log, "a") as f:
        f.write("$ draftline " + shlex.join(args) + "\n")
        f.flush()
        code = subprocess.run([sys.executable, "-m", "draftline", *args], stdout=f, stderr=subprocess.STDOUT,
                              env=env).returncode
    if code != 0:
        raise RuntimeError(f"`draftline {args[0]}` failed (exit {code}); see {log}")
    return time.time() - start


def run_variant(cfg: DemoConfig, data: Path, out: Path, name: str, extra: list[str], env: dict) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    args = train_args(cfg, data, folder / "run")
    if "--device" in extra:  # e.g. cuda, to see where longer training leads: one colocated process
        for flag in ("--gpus", "--targets", "--device"):
            i = args.index(flag)
            del args[i : i + 2]
    try:
        train_s = _run([*args, *extra], log, env)
        # Evaluation as in the demo: on the CPU in float32.
        eval_s = _run([*eval_args(cfg, folder / "run", folder / "eval.json"), "--device", "cpu"], log, env)
    except RuntimeError as exc:
        return {"name": name, "extra": extra, "error": str(exc)}
    summary = json.loads((folder / "eval.json").read_text())
    steps = [json.loads(line) for line in open(folder / "run" / "metrics.jsonl")]
    train = [r for r in steps if r.get("kind") == "train"]
    return {"name": name, "extra": extra, "tau": summary["tau"], "p": summary["acceptance_by_position"][:4],
            "train_min": train_s / 60, "eval_min": eval_s / 60,
            "train_acc1": (train[-1].get("accuracy_by_position") or [None])[0] if train else None}


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<14} failed: {r['error']}"
    p = ", ".join(f"{x:.2f}" for x in r["p"])
    acc = f"{r['train_acc1']:.2f}" if r["train_acc1"] is not None else "-"
    return f"{r['name']:<14} {r['tau']:>5.2f}  {p:<24} {acc:>10} {r['train_min']:>9.1f}  {' '.join(r['extra'])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="start from the CI demo's settings")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="length of the regenerated replies")
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=FLAGS: extra `draftline train` flags (space separated; empty = the defaults)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per process")
    args = parser.parse_args()

    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out=args.out)
    cfg.eval_prompts = args.eval_prompts
    if args.conversations:
        cfg.conversations = args.conversations
    if args.max_new_tokens:
        cfg.max_new_tokens = args.max_new_tokens
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    variants = []
    for spec in args.variant or ["base="]:
        name, _, flags = spec.partition("=")
        variants.append((name, shlex.split(flags)))

    os.environ["OMP_NUM_THREADS"] = str(max(args.threads, 4))
    start = time.time()
    data, _ = make_data(cfg, out, Stages())
    data_min = (time.time() - start) / 60
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    print(f"\ndemo sweep: {cfg.conversations} conversations x {cfg.max_new_tokens} new tokens, data in {data_min:.1f} min; "
          f"tau on {cfg.eval_prompts} held-out prompts, block {cfg.block_size}; {args.parallel} runs at a time, "
          f"{args.threads} threads per process", flush=True)
    header = f"{'variant':<14} {'tau':>5}  {'P(slot 1..4 accepted)':<24} {'train acc1':>10} {'train min':>9}  flags"
    print(header, flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_variant, cfg, data, out, name, extra, env) for name, extra in variants]
        for future in as_completed(futures):  # each line as soon as its run ends
            print(_row(future.result()), flush=True)
    results = [f.result() for f in futures]
    print("\n" + header)
    for r in results:
        print(_row(r))
    (out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
