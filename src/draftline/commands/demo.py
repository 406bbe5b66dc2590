"""``draftline demo``: the whole product end to end on a CPU with the shipped tiny target."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.errors import DraftlineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("demo-run"), metavar="DIR",
                        help="the directory every stage writes into (data, run, eval, report; default ./demo-run)")
    parser.add_argument("--quick", action="store_true",
                        help="the shortened demo CI runs: less data and fewer steps, same code path, lower tau")
    parser.add_argument("--conversations", type=int, metavar="N",
                        help="training conversations the target regenerates (more: a better drafter, a longer "
                             "regeneration; default: the demo's own, fewer with --quick)")
    parser.add_argument("--epochs", type=int, metavar="N",
                        help="passes of training over the regenerated data (more: a higher tau, a longer run; "
                             "default: the demo's own, fewer with --quick)")


def run(args: argparse.Namespace) -> int:
    from draftline.demo.pipeline import DemoConfig, run_demo

    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out=args.out)
    if args.conversations:
        cfg.conversations = args.conversations
    if args.epochs:
        cfg.epochs = args.epochs
    try:
        run_demo(cfg)
    except RuntimeError as exc:
        raise DraftlineError(str(exc)) from exc
    return 0
