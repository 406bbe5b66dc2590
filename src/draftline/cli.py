"""The ``draftline`` command line: one subcommand per module in ``draftline.commands``.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``; they are imported
only when their command runs, so ``draftline --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from draftline.errors import DraftlineError, MachineError

# name -> (module under draftline.commands, one-line help)
COMMANDS = {
    "demo": ("demo", "run the built-in end-to-end demo on a tiny target (CPU, minutes)"),
    "prepare": ("prepare", "tokenize conversations with the target's chat template into a dataset"),
    "regenerate": ("regenerate", "replace assistant turns with the target's own generations"),
    "plan": ("plan", "measure each role and recommend topology and token budget"),
    "train": ("train", "train a drafter: targets -> hidden-state queue -> drafters"),
    "eval": ("eval", "speculative decoding with a drafter: acceptance length and speedup"),
    "report": ("report", "plots and a one-page summary of a run directory"),
    "export": ("export", "write a drafter checkpoint that DFlash, SGLang and vLLM load"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description="Train DFlash speculative-decoding drafters for any Hugging Face target.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str):
    """``(module, parser)`` of one command, with the module's options."""
    module = importlib.import_module(f"draftline.commands.{COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"draftline {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    module, parser = command_parser(name)
    args = parser.parse_args(argv[1:])
    args.argv = argv[1:]  # the command's own arguments, for commands that re-launch themselves
    try:
        return int(module.run(args) or 0)
    except DraftlineError as exc:  # the user's to fix: exit 2; the machine's (a full disk): 1, the run failed
        print(f"draftline {name}: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, MachineError) else 2
    except KeyboardInterrupt as exc:  # SIGINT (or, for train, SIGTERM) before anything was saved
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"\ndraftline {name}: stopped by {signal.Signals(signum).name}"
              + (" before training began: nothing was saved" if name == "train" else ""), file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
