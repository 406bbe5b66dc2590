"""Time train's preflight on one GPU for a target shape (random weights built from a config).

    python bench/bench_preflight.py --shape 8b --budgets 32768 262144 --json preflight.json

One process plays the colocated rank of ``draftline train`` on one GPU (the target's check, then the
drafter's with the target's transient peak and the hidden-state queue), for each budget and queue
size in turn; the first one pays the kernel compilation that training would pay at its first batches.
Preflight prints every point it measures (the warm-up, the fit, the check point, the verification);
at the end a table gives, per check, the seconds, the check point's error against the fit, the
predicted and the measured peak and the outcome (accepted, or the refusal with what fits).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from workloads import random_target  # noqa: E402 - bench/ is on sys.path when run as a script
from draftline.config import TrainConfig
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.target import TargetFeatures
from draftline.sizing import preflight
from draftline.pipeline.build import build_drafter_worker
from draftline.distributed.health import Health, local_rank_info
from draftline.pipeline.spec import ModelSpec, RunSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32768, 262144])
    parser.add_argument("--q-hs", type=int, nargs="+", default=[8, 2], help="queue sizes to try per budget")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    model = random_target(args.shape, device, torch.bfloat16, "flex_attention")
    drafter_cfg = build_drafter_config(model.config, num_hidden_layers=5, block_size=16)
    layer_ids = drafter_cfg.dflash_config["target_layer_ids"]
    target = TargetFeatures.from_model(model, layer_ids)
    build_s = time.perf_counter() - started
    print(f"built the {args.shape} target and a 5-layer drafter in {build_s:.1f} s", flush=True)
    results = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "build_s": build_s, "runs": []}
    for budget in args.budgets:
        for q_hs in args.q_hs:
            config = TrainConfig()
            config.data.token_budget = budget
            config.topology.q_hs = q_hs
            spec = RunSpec.standalone(config, ModelSpec.from_configs(model.config, drafter_cfg), device)
            worker = build_drafter_worker(spec, Health(local_rank_info(0, "colocated", device)), target=target)
            who = "colocated rank 0"
            record = {"token_budget": budget, "q_hs": q_hs, "max_query_rows": config.engine.max_query_rows,
                      "measured": {}}
            t0 = time.perf_counter()
            try:
                result = preflight.preflight_target(spec, target, who)
                record["measured"]["target"] = result.measured
                record["target_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                record["measured"]["drafter"] = preflight.preflight_drafter(spec, worker, who, result).measured
                record["drafter_s"] = time.perf_counter() - t1
                record["outcome"] = "accepted"
            except DraftlineError as exc:
                record["outcome"] = f"refused: {exc}"
            record["total_s"] = time.perf_counter() - t0
            del worker
            torch.cuda.empty_cache()
            results["runs"].append(record)
            print(f"== budget {budget:,}, q_hs {q_hs}: {record['total_s']:.1f} s, {record['outcome'][:400]}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
    print_table(results["runs"])
    print(f"\nwhole benchmark: {time.perf_counter() - started:.0f} s (building the model: {build_s:.0f} s)")


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def _role_cells(measured: dict | None, seconds) -> list[str]:
    """seconds | check point: error against the fit | predicted | measured (GiB) of one role's check."""
    if not measured:
        return ["-", "not run", "-", "-"]
    check = measured.get("check")
    if check:
        off = (check["measured"] - check["predicted"]) / 2**20
        check_cell = f"{off:+,.0f} MiB ({'holds' if check['trusted'] else 'does not hold'})"
    else:
        check_cell = "measured directly"
    return ["-" if seconds is None else f"{seconds:.1f}", check_cell, _gib(measured.get("predicted")),
            _gib(measured.get("verified"))]


def print_table(runs: list[dict]) -> None:
    head = ["--token-budget", "q_hs", "target s", "target check", "target predicted GiB", "target measured GiB",
            "drafter s", "drafter check", "drafter predicted GiB", "drafter measured GiB", "total s", "outcome"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" if i < len(head) - 1 else "---" for i in range(len(head))) + "|")
    for run in runs:
        measured = run.get("measured", {})
        outcome = run["outcome"]
        if outcome.startswith("refused"):
            role = "drafter" if "the drafter" in outcome else "target"
            at = outcome.find("The largest")
            outcome = f"refused ({role}): {outcome[at:] if at >= 0 else outcome[-200:]}"
        cells = [f"{run['token_budget']:,}", str(run["q_hs"]), *_role_cells(measured.get("target"), run.get("target_s")),
                 *_role_cells(measured.get("drafter"), run.get("drafter_s")), f"{run['total_s']:.1f}", outcome]
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
