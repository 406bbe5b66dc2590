"""``draftline demo``: the whole product end to end on a CPU with the shipped tiny target."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.errors import DraftlineError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("demo-run"), help="where everything goes (default ./demo-run)")
    parser.add_argument("--quick", action="store_true", help="a shorter run (less data, fewer steps): what CI runs")
    parser.add_argument("--conversations", type=int, help="training conversations to regenerate")
    parser.add_argument("--epochs", type=int, help="passes over the regenerated data")


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
