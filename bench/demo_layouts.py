"""The demo's training on each CPU layout of this machine, back to back: which one its advice picks.

    python bench/demo_layouts.py --data demo-run/data --batches 400 [--layouts 2+1,1+1,1+2,colocated2,colocated2-shard,single]

Each layout runs the demo's own ``draftline train`` (its model, objective and schedule) on the same
data for ``--batches`` drafter batches (``--max-steps`` halves with two drafters, whose step is two
batches) with one thread per process on a 2-core machine, as the demo starts it. Printed per
layout: the training's wall time, tokens per second between its first and last monitor record (the
line's start, in-training evaluation and the final measurement left out), and the waits the monitor
saw. Layouts: ``2+1`` (2 target ranks, 1 drafter), ``1+1``, ``1+2`` (1 target, 2
drafters sharded), ``colocated2`` (2 processes, each target and drafter, the drafters replicated: the demo's),
``colocated2-shard`` (the same, the drafters sharded with FSDP2), ``single`` (one process
with every core).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftline.demo.pipeline import DemoConfig, train_args

LAYOUTS = {
    "2+1": (["--gpus", "3", "--targets", "2"], 3, 1),
    "1+1": (["--gpus", "2", "--targets", "1"], 2, 1),
    "1+2": (["--gpus", "3", "--targets", "1"], 3, 2),
    "colocated2": (["--gpus", "2", "--colocated"], 2, 2),  # the demo's: the drafters replicate on CPU
    "colocated2-shard": (["--gpus", "2", "--colocated", "--drafter-state", "shard"], 2, 2),
    "single": (["--gpus", "1"], 1, 1),
}


def _without(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


def run_layout(name: str, data: Path, batches: int, work: Path) -> dict:
    extra, processes, drafters = LAYOUTS[name]
    run_dir = work / name
    args = [a for a in _without(train_args(DemoConfig(), data, run_dir), ("--gpus", "--targets")) if a != "--colocated"]
    args += [*extra, "--max-steps", str(batches // drafters), "--eval-every", "100000"]
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.time()
    result = subprocess.run([sys.executable, "-m", "draftline", *args], env=env, capture_output=True, text=True)
    wall = time.time() - start
    if result.returncode != 0:
        return {"layout": name, "error": result.stderr[-2000:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    first, last = train[0], train[-1]
    rate = (last["tokens"] - first["tokens"]) / max(1e-9, last["time"] - first["time"])
    return {"layout": name, "command": "draftline " + shlex.join(args), "threads": int(threads), "wall_s": wall,
            "steps": last["step"], "ktok_s": rate / 1000,
            "target_wait": sum(r["target_wait"] or 0 for r in train) / len(train),
            "drafter_wait": sum(r["drafter_wait"] or 0 for r in train) / len(train)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a prepared demo dataset (demo-run/data)")
    parser.add_argument("--batches", type=int, default=400, help="drafter batches per layout")
    parser.add_argument("--layouts", default="2+1,1+1,1+2,colocated2,colocated2-shard,single",
                        help="comma-separated layouts, named above (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            r = run_layout(name, args.data.resolve(), args.batches, Path(tmp))
            results.append(r)
            if "error" in r:
                print(f"{name:<11} failed: {r['error']}", flush=True)
            else:
                print(f"{name:<11} {r['wall_s']:>6.1f} s wall  {r['ktok_s']:>5.2f} Ktok/s  steps {r['steps']:>4}  "
                      f"targets wait {r['target_wait']:.0%}  drafters wait {r['drafter_wait']:.0%}  "
                      f"({r['threads']} thread(s) per process)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
