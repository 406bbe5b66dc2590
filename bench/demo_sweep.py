"""Try training settings on the demo's data, several at once, and print one table of acceptance.

    python bench/demo_sweep.py --out sweep --conversations 832 --max-steps 777 --seeds 0,1 \
        --pin "0,1 2,3 4,5 6,7 8,9 10,11 12,13" \
        --variant base= --variant lr6=--lr=6e-3 --variant "a8@0=--max-anchors=8 --max-steps=1040"

Stages 1-3 of the demo (conversations, the tiny target's replies, the packed dataset) run once, or
not at all with ``--data`` (a dataset an earlier sweep prepared); then every variant runs the demo's
``draftline train`` (2 colocated processes, each a target and a drafter, the drafters replicated;
gloo) with its extra flags appended (a repeated flag overrides the demo's: ``--max-steps`` too, whose
``--eval-every`` follows it), and ``draftline eval`` on the held-out prompts, once per seed: those of
``--seeds``, or a variant's own (``NAME@0,1,2=FLAGS``), each appended as ``--seed N`` (run ``NAME-sN``).
The last table gives each variant's tau per seed, their mean and spread.

``--pin`` gives each running variant its own cores (``taskset -c``), taken from a queue of slots and
given back when its eval ends, so the runs do not share cores: as many run at once as there are
slots, each with the demo's threads on its slot (one per training process on a core pair, and the
eval's one process every core of it). ``--probe`` first times the demo's probe (``measure_speed``)
on each slot, one slot at a time, to say how fast the slots are against the demo's machines.
Without ``--pin``, ``--parallel`` runs share the machine, ``--threads`` threads per process.

Time columns are wall time on THIS machine: ``train min`` is the whole ``draftline train`` command
(its start and final checkpoint included), ``s/step`` the training's own time per step (its end
record; the small evaluations in it included). Runs at once slow each other (memory bandwidth):
compare the runs of one sweep with each other, not with the demo's minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from draftline.demo.pipeline import TARGET, DemoConfig, Stages, eval_args, make_data, train_args


def _flag(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), or None."""
    value = None
    for i, item in enumerate(args):
        if item == flag and i + 1 < len(args):
            value = args[i + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


def _without(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """``args`` less each of ``flags`` and its value."""
    out, skip = [], False
    for item in args:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif not item.startswith(tuple(f + "=" for f in flags)):
            out.append(item)
    return out


class Runner:
    """Runs ``draftline`` commands, pinned to a slot of cores (``taskset -c``) or unpinned."""

    def __init__(self, slots: list[str] | None, threads: int):
        self.slots: queue.Queue[str] | None = None
        if slots:
            self.slots = queue.Queue()
            for slot in slots:
                self.slots.put(slot)
        self.threads = threads

    def take(self) -> str | None:
        return None if self.slots is None else self.slots.get()

    def give(self, slot: str | None) -> None:
        if self.slots is not None and slot is not None:
            self.slots.put(slot)

    def env(self, slot: str | None, processes: int) -> dict:
        """The demo's threads (``Stages.command``): the slot's cores shared out over the processes."""
        threads = self.threads if slot is None else max(1, min(4, len(_cores(slot)) // processes))
        return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    def run(self, args: list[str], log: Path, slot: str | None, processes: int) -> float:
        """Run ``draftline ARGS`` (``processes``: the processes it starts), its output to ``log``;
        returns its wall seconds."""
        command = [sys.executable, "-m", "draftline", *args]
        if slot is not None:
            command = ["taskset", "-c", slot, *command]
        start = time.time()
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(command)}\n")
            f.flush()
            code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=self.env(slot, processes)).returncode
        if code != 0:
            raise RuntimeError(f"`draftline {args[0]}` failed (exit {code}); see {log}")
        return time.time() - start


def _cores(slot: str) -> set[int]:
    """The cores of a ``taskset -c`` list such as ``0,1`` or ``4-7``."""
    cores: set[int] = set()
    for part in slot.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def probe_slots(slots: list[str]) -> dict[str, float]:
    """The demo's probe on each slot, one slot at a time (this thread pinned to it meanwhile)."""
    from draftline.sizing.demo import measure_speed

    mask = os.sched_getaffinity(0)
    probes = {}
    try:
        for slot in slots:
            os.sched_setaffinity(0, _cores(slot))
            probes[slot] = round(measure_speed(TARGET), 4)
    finally:
        os.sched_setaffinity(0, mask)
    return probes


def run_variant(cfg: DemoConfig, data: Path, out: Path, name: str, extra: list[str], runner: Runner,
                max_steps: int | None) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    steps = int(_flag(extra, "--max-steps") or 0) or max_steps
    args = train_args(cfg, data, folder / "run", steps)
    processes = cfg.gpus
    if "--device" in extra:  # e.g. cuda, to see where longer training leads: one colocated process
        args, processes = _without(args, ("--gpus", "--device")), 1
    slot = runner.take()
    result = {"name": name, "extra": extra, "seed": int(_flag(extra, "--seed") or cfg.seed), "cores": slot}
    try:
        train_s = runner.run([*args, *extra], log, slot, processes)
        # Evaluation as in the demo: on the CPU in float32.
        eval_s = runner.run([*eval_args(cfg, folder / "run", folder / "eval.json"), "--device", "cpu"], log, slot, 1)
    except RuntimeError as exc:
        return {**result, "error": str(exc)}
    finally:
        runner.give(slot)
    summary = json.loads((folder / "eval.json").read_text())
    records = [json.loads(line) for line in open(folder / "run" / "metrics.jsonl")]
    train = [r for r in records if r.get("kind") == "train"]
    end = next((r for r in reversed(records) if r.get("kind") == "end"), {})
    trained = end.get("step") or 0
    return {**result, "tau": summary["tau"], "p": summary["acceptance_by_position"][:4],
            "train_min": train_s / 60, "eval_min": eval_s / 60, "steps": trained,
            "step_s": end["elapsed_s"] / trained if trained else None, "ended_by": end.get("reason") or "last step",
            "train_acc1": (train[-1].get("accuracy_by_position") or [None])[0] if train else None}


HEADER = (f"{'run':<16} {'tau':>5}  {'P(slot 1..4 accepted)':<24} {'train acc1':>10} {'steps':>5} {'s/step':>6} "
          f"{'train min':>9} {'cores':>6}  flags")


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<16} failed: {r['error']}"
    p = ", ".join(f"{x:.2f}" for x in r["p"])
    acc = f"{r['train_acc1']:.2f}" if r["train_acc1"] is not None else "-"
    step_s = f"{r['step_s']:.3f}" if r["step_s"] else "-"
    return (f"{r['name']:<16} {r['tau']:>5.3f}  {p:<24} {acc:>10} {r['steps']:>5} {step_s:>6} {r['train_min']:>9.2f} "
            f"{r['cores'] or '-':>6}  {' '.join(r['extra'])}")


def arm_table(results: list[dict], arms: list[str]) -> list[str]:
    """One line per variant: its seeds' tau, their mean and spread, the mean train minutes and steps."""
    lines = [f"{'variant':<12} {'seeds':<7} {'tau per seed':<24} {'mean':>6} {'spread':>6} {'train min':>9} "
             f"{'steps':>5}  flags"]
    for arm in arms:
        runs = [r for r in results if r["arm"] == arm and "error" not in r]
        if not runs:
            lines.append(f"{arm:<12} no run finished")
            continue
        taus = [r["tau"] for r in runs]
        seeds = ",".join(str(r["seed"]) for r in runs)
        flags = " ".join(_without(runs[0]["extra"], ("--seed",)))
        lines.append(f"{arm:<12} {seeds:<7} {', '.join(f'{t:.3f}' for t in taus):<24} {statistics.mean(taus):>6.3f} "
                     f"{max(taus) - min(taus):>6.3f} {statistics.mean(r['train_min'] for r in runs):>9.2f} "
                     f"{round(statistics.mean(r['steps'] for r in runs)):>5}  {flags}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="start from the CI demo's settings")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="length of the regenerated replies")
    parser.add_argument("--data", type=Path, default=None,
                        help="a dataset prepared before (an earlier sweep's OUT/data): stages 1-3 do not run")
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--max-steps", type=int, default=None,
                        help="every variant's --max-steps (and --eval-every after it, as the demo's); a variant's "
                             "own --max-steps wins. None: the demo's epochs")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated: each variant once per seed (--seed N appended; run NAME-sN)")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME[@SEEDS]=FLAGS: extra `draftline train` flags (space separated; empty = the "
                             "defaults); SEEDS (comma-separated) instead of --seeds for this variant")
    parser.add_argument("--pin", default=None,
                        help='slots of cores, space separated ("0,1 2,3 4,5"): each running variant gets one '
                             "(taskset -c), as many run at once as there are slots")
    parser.add_argument("--probe", action="store_true", help="time the demo's probe on each --pin slot first")
    parser.add_argument("--parallel", type=int, default=4, help="runs at a time without --pin")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per process without --pin")
    parser.add_argument("--data-threads", type=int, default=4, help="OMP threads of stages 1-3")
    args = parser.parse_args()

    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out=args.out)
    cfg.eval_prompts = args.eval_prompts
    if args.conversations:
        cfg.conversations = args.conversations
    if args.max_new_tokens:
        cfg.max_new_tokens = args.max_new_tokens
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    arms, variants = [], []
    for spec in args.variant or ["base="]:
        arm, _, flags = spec.partition("=")
        arm, _, own_seeds = arm.partition("@")
        seeds = own_seeds or args.seeds
        if arm not in arms:
            arms.append(arm)
        for seed in seeds.split(",") if seeds else [None]:
            extra = shlex.split(flags) + ([] if seed is None else ["--seed", seed])
            variants.append((arm, f"{arm}-s{_flag(extra, '--seed') or cfg.seed}", extra))
    names = [name for _, name, _ in variants]
    if len(set(names)) < len(names):
        parser.error(f"two runs of one name: {names}")
    slots = args.pin.split() if args.pin else None
    runner = Runner(slots, args.threads)
    parallel = len(slots) if slots else args.parallel

    info: dict = {"conversations": cfg.conversations, "max_steps": args.max_steps, "slots": slots}
    if slots and args.probe:
        info["probe_s"] = probe_slots(slots)
        print("probe (s) per slot: " + ", ".join(f"{s}: {p:.3f}" for s, p in info["probe_s"].items()), flush=True)
    start = time.time()
    if args.data is None:
        os.environ["OMP_NUM_THREADS"] = str(args.data_threads)
        data, info["regenerated"] = make_data(cfg, out, Stages())
    else:
        data = args.data.resolve()
    info["data_min"] = round((time.time() - start) / 60, 2)
    print(f"\ndemo sweep: {info.get('regenerated', '?')} conversations x {cfg.max_new_tokens} new tokens "
          f"({data}), data in {info['data_min']:.1f} min; tau on {cfg.eval_prompts} held-out prompts, "
          f"block {cfg.block_size}; {parallel} runs at a time"
          + (f", pinned to {args.pin}" if slots else f", {args.threads} threads per process"), flush=True)
    print(HEADER, flush=True)
    start = time.time()
    results = []
    with ThreadPoolExecutor(parallel) as pool:
        futures = {pool.submit(run_variant, cfg, data, out, name, extra, runner, args.max_steps): arm
                   for arm, name, extra in variants}
        for future in as_completed(futures):  # each line as soon as its run ends, the json too
            results.append({**future.result(), "arm": futures[future]})
            print(_row(results[-1]), flush=True)
            (out / "sweep.json").write_text(json.dumps({**info, "runs": results}, indent=2) + "\n")
    info["runs_min"] = round((time.time() - start) / 60, 2)
    results.sort(key=lambda r: names.index(r["name"]))
    print("\n" + HEADER)
    for r in results:
        print(_row(r))
    print(f"\nruns in {info['runs_min']:.1f} min\n" + "\n".join(arm_table(results, arms)))
    (out / "sweep.json").write_text(json.dumps({**info, "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
