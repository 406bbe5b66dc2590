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
    parser.add_argument("--minutes", type=float, metavar="MIN",
                        help="the demo's time on this machine: it measures the machine's speed first, then "
                             "regenerates as many conversations and trains as many steps as fit (default 7.5; `make "
                             "demo` passes 9.5 with --since, so that with its set-up it ends within 10 minutes; 0: "
                             "every epoch of the demo's 1,280 conversations, however long; --quick is fixed-size)")
    parser.add_argument("--since", type=float, metavar="UNIX_TIME",
                        help="count --minutes from this time instead of the demo's own start (`make demo` passes the "
                             "time it was typed, so its set-up counts)")
    parser.add_argument("--conversations", type=int, metavar="N",
                        help="training conversations the target regenerates (more: a better drafter, a longer "
                             "regeneration; default: the demo's own, fewer with --quick)")
    parser.add_argument("--epochs", type=int, metavar="N",
                        help="passes of training over the regenerated data (more: a higher tau, a longer run; "
                             "default: the demo's own, fewer with --quick)")


def run(args: argparse.Namespace) -> int:
    from draftline.demo.pipeline import DemoConfig, run_demo

    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out=args.out)
    if args.minutes is not None:
        cfg.minutes = args.minutes or None
    if args.since is not None and cfg.minutes is not None:
        cfg.since = args.since
    if args.conversations:
        cfg.conversations = args.conversations
        cfg.keep_conversations = True
    if args.epochs:
        cfg.epochs = args.epochs
    try:
        run_demo(cfg)
    except RuntimeError as exc:
        raise DraftlineError(str(exc)) from exc
    return 0
