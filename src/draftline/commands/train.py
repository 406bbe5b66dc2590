"""``draftline train``: targets -> hidden-state queue -> drafters.

One GPU (or CPU): ``draftline train --target DIR --data DATA --out RUN`` runs target and drafter
in one process. One node: ``draftline train --gpus 8 ...`` (or ``torchrun --nproc-per-node 8 -m
draftline train ...``). Many nodes: ``torchrun`` as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from draftline.config import TrainConfig, apply_dict, load_config_file

# flag -> (section, field, type); None type = boolean switch
_FLAGS: dict[str, tuple[str, str, object]] = {
    "--target": ("model", "target", str),
    "--draft-layers": ("model", "draft_layers", int),
    "--block-size": ("model", "block_size", int),
    "--target-layer-ids": ("model", "target_layer_ids", lambda s: [int(x) for x in s.split(",")]),
    "--mask-token-id": ("model", "mask_token_id", int),
    "--sliding-window": ("model", "sliding_window", int),
    "--layer-types": ("model", "layer_types", lambda s: s.split(",")),
    "--init-drafter": ("model", "init_drafter", str),
    "--init-from-target": ("model", "init_from_target", None),
    "--dtype": ("model", "dtype", str),
    "--token-budget": ("data", "token_budget", int),
    "--max-batch-size": ("data", "max_batch_size", int),
    "--max-anchors": ("data", "max_anchors", int),
    "--max-length": ("data", "max_length", int),
    "--epochs": ("data", "epochs", int),
    "--seed": ("data", "seed", int),
    "--lr": ("optim", "lr", float),
    "--min-lr-ratio": ("optim", "min_lr_ratio", float),
    "--warmup-ratio": ("optim", "warmup_ratio", float),
    "--weight-decay": ("optim", "weight_decay", float),
    "--grad-clip": ("optim", "grad_clip", float),
    "--grad-accum": ("optim", "grad_accum", int),
    "--loss-gamma": ("optim", "loss_gamma", float),
    "--distill": ("optim", "distill", float),
    "--global-batch-tokens": ("optim", "global_batch_tokens", int),
    "--max-steps": ("optim", "max_steps", int),
    "--targets": ("topology", "targets", int),
    "--drafters": ("topology", "drafters", int),
    "--colocated": ("topology", "colocated", None),
    "--q-pre": ("topology", "q_pre", int),
    "--q-hs": ("topology", "q_hs", int),
    "--device": ("topology", "device", str),
    "--failure-timeout": ("topology", "failure_timeout_s", float),
    "--save-every": ("checkpoint", "every_steps", int),
    "--save-every-minutes": ("checkpoint", "every_minutes", float),
    "--keep": ("checkpoint", "keep", int),
    "--resume": ("checkpoint", "resume", None),
    "--from-scratch": ("checkpoint", "from_scratch", None),
    "--log-every": ("monitor", "interval_s", float),
    "--no-tensorboard": ("monitor", "tensorboard", "off"),
    "--wandb": ("monitor", "wandb", None),
    "--wandb-project": ("monitor", "wandb_project", str),
    "--eval-every": ("monitor", "eval_every", int),
    "--eval-prompts": ("monitor", "eval_prompts", str),
    "--eval-num-prompts": ("monitor", "eval_num_prompts", int),
    "--eval-max-new-tokens": ("monitor", "eval_max_new_tokens", int),
    "--peak-tflops": ("monitor", "peak_tflops", float),
    "--attention": ("engine", "attention", str),
    "--head-chunk-rows": ("engine", "head_chunk_rows", int),
    "--max-query-rows": ("engine", "max_query_rows", int),
    "--activation-checkpointing": ("engine", "activation_checkpointing", None),
    "--no-compile": ("engine", "compile_drafter", "off"),
    "--no-preflight": ("engine", "preflight", "off"),
    "--memory-headroom-gib": ("engine", "memory_headroom_gib", float),
    "--trace": ("engine", "trace", None),
}


def _help(section: str, name: str) -> str:
    import dataclasses

    from draftline import config as cfg

    cls = {"model": cfg.ModelConfig, "data": cfg.DataConfig, "optim": cfg.OptimConfig, "topology": cfg.TopologyConfig,
           "checkpoint": cfg.CheckpointConfig, "monitor": cfg.MonitorConfig, "engine": cfg.EngineConfig}[section]
    default = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = default.default if default.default is not dataclasses.MISSING else default.default_factory()
    return f"{section}.{name} (default {default!r})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML or JSON file with [model], [data], [optim], ... sections; flags override it")
    parser.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, tensorboard/, final/)")
    parser.add_argument("--data", nargs="+", help="a prepared dataset directory (written by `draftline prepare`)")
    parser.add_argument("--gpus", "--nproc", dest="gpus", type=int,
                        help="launch this many processes on this node with torchrun (one per GPU; with --device cpu, CPU processes)")
    parser.add_argument("--max-restarts", type=int, default=0, help="with --gpus: torchrun restarts after a failure (each resumes)")
    for flag, (section, name, kind) in _FLAGS.items():
        if kind is None:
            parser.add_argument(flag, action="store_true", default=None, help=_help(section, name))
        elif kind == "off":
            parser.add_argument(flag, action="store_false", default=None, help=f"turn off {_help(section, name)}")
        else:
            parser.add_argument(flag, type=kind, help=_help(section, name))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    config = TrainConfig()
    if args.config:
        apply_dict(config, load_config_file(args.config), args.config)
    overrides: dict[str, dict] = {}
    for flag, (section, name, _kind) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    if args.data:
        overrides.setdefault("data", {})["data"] = list(args.data)
    if args.out:
        overrides["out"] = args.out
    apply_dict(config, overrides, "command line")
    return config


def _cpu_launch_env(device: str) -> None:
    """CPU ranks share the cores: OpenMP threads that spin while they wait take the CPU from the
    rank that has work (measured on 2 cores, 2 targets + 1 drafter: 1.27 -> 1.88 drafter batches/s).
    Waiting threads sleep instead, unless the user chose a policy."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _launch(args: argparse.Namespace, argv: list[str], out: str, device: str) -> int:
    """Re-run this command under torchrun with ``args.gpus`` local processes."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _cpu_launch_env(device)

    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--gpus", "--nproc", "--max-restarts"):
            skip = True
            continue
        if item.startswith(("--gpus=", "--nproc=", "--max-restarts=")):
            continue
        rest.append(item)
    torchrun_args = ["--standalone", f"--nproc-per-node={args.gpus}", f"--max-restarts={args.max_restarts}",
                     "-m", "draftline", "train", *rest]
    started = time.time()
    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        code = first.exitcode
        culprit = _name_failed_rank(Path(out), rank, first, started)
        print(f"draftline: the run failed: {culprit} (see the ranks' messages above)", file=sys.stderr)
        return code if code and code > 0 else 1
    return 0


def _name_failed_rank(run_dir: Path, rank: int, failure, started: float) -> str:
    """The first rank torchrun saw fail, named from its record in RUN_DIR/ranks (role, host, GPU, pid).

    torchrun may notice a killed rank and stop the others before their watchdogs name it; then this
    is the only place that can, so it also writes RUN_DIR/failure.json if no rank did.
    """
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    name = f"rank {rank} (pid {failure.pid})"
    record = run_dir / "ranks" / f"rank-{rank}.json"
    try:
        info = json.loads(record.read_text())
        name = f"{info['role']} rank {rank} (host {info['host']}, {info['gpu']}, pid {info['pid']})"
    except (OSError, ValueError, KeyError):
        pass
    message = f"{name} died ({how})"
    failure_json = run_dir / "failure.json"
    try:
        written = json.loads(failure_json.read_text())["time"] >= started  # by a rank of this launch
    except (OSError, ValueError, KeyError):
        written = False
    if written:  # a rank's watchdog named the culprit; it may have stopped the others before torchrun saw it
        return json.loads(failure_json.read_text())["message"]
    if run_dir.is_dir() and not written:
        failure_json.write_text(json.dumps({"time": time.time(), "message": message, "step": None,
                                            "checkpoint": None}, indent=2) + "\n")
    return message


def run(args: argparse.Namespace) -> int:
    from draftline.config import validate
    from draftline.pipeline.run import run_training

    config = config_from_args(args)
    validate(config)
    if args.gpus and args.gpus > 1 and "LOCAL_RANK" not in os.environ:
        return _launch(args, list(getattr(args, "argv", sys.argv[2:])), config.out, config.topology.device)
    return run_training(config)
