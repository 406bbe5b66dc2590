"""``draftline train``: targets -> hidden-state queue -> drafters.

One GPU (or CPU): ``draftline train --target DIR --data DATA --out RUN`` runs target and drafter
in one process. One node: ``draftline train --gpus 8 ...`` (or ``torchrun --nproc-per-node 8 -m
draftline train ...``). Many nodes: ``torchrun`` as usual.
"""

from __future__ import annotations

import argparse
import os
import sys

from draftline.config_flags import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every config field's option (``draftline.config_flags``), grouped by config section, and the launcher's."""
    parser.description = (
        "Train a DFlash drafter: targets -> hidden-state queue -> drafters. Every option below is also a field "
        "of a TOML or JSON config file (--config; the flag overrides the file), shown after its text as "
        "[section] field."
    )
    groups = add_config_arguments(parser)
    groups["topology"].add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="with --gpus: times torchrun restarts the whole job after a rank fails; each restart resumes from the "
             "latest checkpoint (a command-line option only; default: 0)")


def run(args: argparse.Namespace) -> int:
    from draftline.distributed.signals import handlers_kept

    with handlers_kept():  # called in a process that goes on (tests): its own handlers back at the end
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from draftline.distributed.signals import interrupt_until_training

    interrupt_until_training()  # a stop before the line handles signals: a message, not a traceback
    from draftline.config import validate
    from draftline.distributed.launch import die_with_launcher, launch
    from draftline.errors import DraftlineError

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
    from draftline.pipeline.run import run_training  # the line's imports (~2 s of torch, transformers) in ranks only

    return run_training(config)
