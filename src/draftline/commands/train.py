"""``draftline train``: targets -> hidden-state queue -> drafters.

One GPU (or CPU): ``draftline train --target DIR --data DATA --out RUN`` runs target and drafter
in one process. One node: ``draftline train --gpus 8 ...`` (or ``torchrun --nproc-per-node 8 -m
draftline train ...``). Many nodes: ``torchrun`` as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import types
import typing
from pathlib import Path

from draftline.config import TrainConfig, apply_dict, field_types, load_config_file
from draftline.cores import usable_cores

# flag -> (section, field). The flag's type comes from the field's annotation in draftline.config (one
# typed source for flags and config files): int/float/str as such, list[...] comma-separated, bool a switch.
_FLAGS: dict[str, tuple[str, str]] = {
    "--target": ("model", "target"),
    "--draft-layers": ("model", "draft_layers"),
    "--block-size": ("model", "block_size"),
    "--target-layer-ids": ("model", "target_layer_ids"),
    "--mask-token-id": ("model", "mask_token_id"),
    "--sliding-window": ("model", "sliding_window"),
    "--layer-types": ("model", "layer_types"),
    "--init-drafter": ("model", "init_drafter"),
    "--init-from-target": ("model", "init_from_target"),
    "--random-init": ("model", "init_from_target"),
    "--dtype": ("model", "dtype"),
    "--token-budget": ("data", "token_budget"),
    "--max-batch-size": ("data", "max_batch_size"),
    "--max-anchors": ("data", "max_anchors"),
    "--max-length": ("data", "max_length"),
    "--sort-window": ("data", "sort_window"),
    "--epochs": ("data", "epochs"),
    "--seed": ("data", "seed"),
    "--no-balance-steps": ("data", "balance_steps"),
    "--lr": ("optim", "lr"),
    "--min-lr-ratio": ("optim", "min_lr_ratio"),
    "--warmup-ratio": ("optim", "warmup_ratio"),
    "--weight-decay": ("optim", "weight_decay"),
    "--betas": ("optim", "betas"),
    "--grad-clip": ("optim", "grad_clip"),
    "--grad-accum": ("optim", "grad_accum"),
    "--loss-gamma": ("optim", "loss_gamma"),
    "--loss": ("optim", "loss"),
    "--dpace-alpha": ("optim", "dpace_alpha"),
    "--distill": ("optim", "distill"),
    "--global-batch-tokens": ("optim", "global_batch_tokens"),
    "--max-steps": ("optim", "max_steps"),
    "--max-minutes": ("optim", "max_minutes"),
    "--max-bad-steps": ("optim", "max_bad_steps"),
    "--targets": ("topology", "targets"),
    "--drafters": ("topology", "drafters"),
    "--colocated": ("topology", "colocated"),
    "--drafter-state": ("topology", "drafter_state"),
    "--q-pre": ("topology", "q_pre"),
    "--q-hs": ("topology", "q_hs"),
    "--device": ("topology", "device"),
    "--failure-timeout": ("topology", "failure_timeout_s"),
    "--save-every": ("checkpoint", "every_steps"),
    "--save-every-minutes": ("checkpoint", "every_minutes"),
    "--keep": ("checkpoint", "keep"),
    "--resume": ("checkpoint", "resume"),
    "--from-scratch": ("checkpoint", "from_scratch"),
    "--log-every": ("monitor", "interval_s"),
    "--no-tensorboard": ("monitor", "tensorboard"),
    "--wandb": ("monitor", "wandb"),
    "--wandb-project": ("monitor", "wandb_project"),
    "--eval-every": ("monitor", "eval_every"),
    "--eval-prompts": ("monitor", "eval_prompts"),
    "--eval-num-prompts": ("monitor", "eval_num_prompts"),
    "--eval-max-new-tokens": ("monitor", "eval_max_new_tokens"),
    "--eval-final-num-prompts": ("monitor", "eval_final_num_prompts"),
    "--eval-final-max-new-tokens": ("monitor", "eval_final_max_new_tokens"),
    "--peak-tflops": ("monitor", "peak_tflops"),
    "--attention": ("engine", "attention"),
    "--head-chunk-rows": ("engine", "head_chunk_rows"),
    "--max-query-rows": ("engine", "max_query_rows"),
    "--activation-checkpointing": ("engine", "activation_checkpointing"),
    "--no-compile": ("engine", "compile"),
    "--no-preflight": ("engine", "preflight"),
    "--memory-headroom-gib": ("engine", "memory_headroom_gib"),
    "--gpu-memory-gib": ("engine", "gpu_memory_gib"),
    "--trace": ("engine", "trace"),
}
_OFF_SWITCHES = {"--no-tensorboard", "--no-preflight", "--no-compile", "--no-balance-steps", "--random-init"}  # these turn a default-on bool field off


# Two flags of one field: --random-init carries the field's docstring, --init-from-target says what it does.
_SWITCH_DOCS = {
    "--init-from-target": "Start the drafter from the target's top layers (the default without --init-drafter): every "
                          "part whose names and shapes match, the final norm, fc passing the deepest feature layer "
                          "through; +21-26% acceptance at equal compute in bench/quality.py's comparison.",
}

# What a flag's value is, in its usage line: the unit where there is one, else the kind of value.
_METAVARS = {
    "--target": "DIR", "--init-drafter": "DIR", "--eval-prompts": "FILE", "--wandb-project": "NAME",
    "--dtype": "{auto,bfloat16,float32}", "--device": "{auto,cuda,cpu}", "--drafter-state": "{auto,shard,replicate}", "--attention": "{auto,flex,flash,dense}",
    "--layer-types": "TYPE,TYPE,...", "--target-layer-ids": "ID,ID,...", "--betas": "BETA1,BETA2",
    "--token-budget": "TOKENS", "--global-batch-tokens": "TOKENS", "--max-length": "TOKENS",
    "--sliding-window": "TOKENS", "--mask-token-id": "TOKEN_ID", "--eval-max-new-tokens": "TOKENS",
    "--eval-final-max-new-tokens": "TOKENS", "--max-anchors": "ANCHORS", "--max-batch-size": "DOCS",
    "--sort-window": "SAMPLES", "--max-steps": "STEPS", "--max-minutes": "MINUTES", "--max-bad-steps": "STEPS", "--save-every": "STEPS",
    "--eval-every": "STEPS", "--save-every-minutes": "MINUTES", "--log-every": "SECONDS",
    "--failure-timeout": "SECONDS", "--peak-tflops": "TFLOPS", "--memory-headroom-gib": "GIB",
    "--head-chunk-rows": "ROWS", "--max-query-rows": "ROWS", "--q-pre": "BATCHES", "--q-hs": "BATCHES",
    "--grad-accum": "BATCHES", "--eval-num-prompts": "PROMPTS", "--eval-final-num-prompts": "PROMPTS",
    "--targets": "RANKS", "--drafters": "RANKS", "--draft-layers": "LAYERS", "--block-size": "TOKENS",
    "--epochs": "EPOCHS", "--keep": "CHECKPOINTS", "--lr": "LR", "--min-lr-ratio": "RATIO",
    "--warmup-ratio": "RATIO", "--distill": "WEIGHT", "--loss-gamma": "POSITIONS", "--loss": "{dflash,dpace}", "--dpace-alpha": "ALPHA", "--grad-clip": "NORM",
    "--weight-decay": "X", "--seed": "N",
}


def _section_class(section: str) -> type:
    return type(getattr(TrainConfig(), section))


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help strings with %


def _help(flag: str, section: str, name: str) -> str:
    """The field's own docstring (draftline.config), then where it lives in a config file and its default."""
    from draftline.config_docs import field_docs

    default = getattr(getattr(TrainConfig(), section), name)
    doc = field_docs(_section_class(section)).get(name, "")
    if flag in _SWITCH_DOCS:
        doc = _SWITCH_DOCS[flag]
    if flag in _OFF_SWITCHES:
        where = f"[{section}] {name} = false; default: on"
    elif isinstance(default, bool):
        where = f"[{section}] {name} = true; default: off"
    elif default in ("", []):
        where = f"[{section}] {name}"
    else:
        shown = "none" if default is None else ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        where = f"[{section}] {name}; default: {shown}"
    return _escape(f"{doc} ({where})" if doc else f"({where})")


def _flag_type(section: str, name: str):
    """The argparse type of a field's flag, from its annotation (``X | None`` as ``X``)."""
    hint = field_types(_section_class(section))[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return bool
    if typing.get_origin(hint) in (list, tuple):  # a tuple's length is checked with the config's other checks
        item = typing.get_args(hint)[0]

        def comma_list(text: str) -> list:
            try:
                return [item(x) for x in text.split(",")]
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__} values, got {text!r}") from None

        comma_list.__name__ = f"comma-separated {item.__name__} list"
        return comma_list
    assert hint in (int, float, str), f"{section}.{name}: a flag for type {hint} needs a parser here"
    return hint


def _metavar(flag: str, kind) -> str:
    if flag in _METAVARS:
        return _METAVARS[flag]
    return {int: "N", float: "X", str: "VALUE"}.get(kind, "A,B,...")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options grouped by config section, each explained by its field's docstring in draftline.config."""
    from draftline.config_docs import field_docs, section_doc

    parser.description = (
        "Train a DFlash drafter: targets -> hidden-state queue -> drafters. Every option below is also a field "
        "of a TOML or JSON config file (--config; the flag overrides the file), shown after its text as "
        "[section] field."
    )
    run_group = parser.add_argument_group("run", "The config file and the run directory.")
    run_group.add_argument("--config", metavar="FILE",
                           help="a TOML or JSON file with [model], [data], [optim], ... sections (the fields "
                                "below); flags given as well override it")
    run_group.add_argument("--out", metavar="DIR", help=_escape(f"{field_docs(TrainConfig)['out']} (out, at the "
                                                                "top of a config file)"))
    groups = {}
    for section in ("model", "data", "optim", "topology", "checkpoint", "monitor", "engine"):
        about = section_doc(_section_class(section)).removeprefix(f"[{section}]").strip()
        groups[section] = parser.add_argument_group(f"[{section}]", _escape(about))
    groups["data"].add_argument("--data", nargs="+", metavar="DIR", help=_help("--data", "data", "data"))
    topology = groups["topology"]
    topology.add_argument("--gpus", "--nproc", dest="gpus", type=int, metavar="N", help=_help("--gpus", "topology", "gpus"))
    topology.add_argument("--max-restarts", type=int, default=0, metavar="N",
                          help="with --gpus: times torchrun restarts the whole job after a rank fails; each restart "
                               "resumes from the latest checkpoint (a command-line option only; default: 0)")
    for flag, (section, name) in _FLAGS.items():
        kind = _flag_type(section, name)
        group = groups[section]
        if flag in _OFF_SWITCHES:
            group.add_argument(flag, action="store_false", default=None, help=_help(flag, section, name))
        elif kind is bool:
            group.add_argument(flag, action="store_true", default=None, help=_help(flag, section, name))
        else:
            group.add_argument(flag, type=kind, metavar=_metavar(flag, kind), help=_help(flag, section, name))


def explain_like_train(parser: argparse.ArgumentParser) -> None:
    """Give an option of another command that has no help of its own, and is also a ``train`` option
    (plan's --token-budget, --max-anchors, ...), train's explanation: one source for what it means."""
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o in _FLAGS), None)
        if action.help is None and flag is not None:
            section, name = _FLAGS[flag]
            from draftline.config_docs import field_docs

            doc = field_docs(_section_class(section)).get(name)
            if doc:
                action.help = _escape(doc) + " (as in train; default: %(default)s)"
            if action.metavar is None and action.nargs is None and action.type is not None:
                action.metavar = _METAVARS.get(flag)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    config = TrainConfig()
    if args.config:
        apply_dict(config, load_config_file(args.config), args.config)
    overrides: dict[str, dict] = {}
    for flag, (section, name) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides.setdefault(section, {})[name] = value
    if args.gpus is not None:
        overrides.setdefault("topology", {})["gpus"] = args.gpus
    if args.data:
        overrides.setdefault("data", {})["data"] = list(args.data)
    if args.out:
        overrides["out"] = args.out
    apply_dict(config, overrides, "command line")
    return config


def run(args: argparse.Namespace) -> int:
    from draftline.distributed.signals import interrupt_until_training

    interrupt_until_training()  # a stop before the line handles signals: a message, not a traceback
    from draftline.config import validate
    from draftline.distributed.launch import die_with_launcher, launch
    from draftline.errors import DraftlineError
    from draftline.pipeline.run import run_training

    config = config_from_args(args)
    validate(config)
    gpus = config.topology.gpus  # --gpus, or topology.gpus of a config file
    if args.max_restarts < 0:
        raise DraftlineError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.max_restarts and not (gpus and gpus > 1 and "LOCAL_RANK" not in os.environ):
        raise DraftlineError("--max-restarts needs --gpus N (or topology.gpus) > 1: it is torchrun's restart count; "
                             "a job started by torchrun itself takes torchrun's own --max-restarts")
    if gpus and gpus > 1 and "LOCAL_RANK" not in os.environ:
        from draftline.distributed.rundir import check_run_dir_free

        check_run_dir_free(config.out)  # refused before any rank starts; rank 0 takes the lock itself
        return launch(gpus, args.max_restarts, list(getattr(args, "argv", sys.argv[2:])), config.out,
                      config.topology.device)
    die_with_launcher()
    return run_training(config)
