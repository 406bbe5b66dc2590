"""``draftline prepare --target DIR --input FILE... --out DATA_DIR``: conversations to a token dataset."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from draftline.data.prepare import PrepareConfig, format_stats, prepare

_THINKING = {"on": True, "off": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, required=True, help="target model directory (tokenizer, chat template, config.json)")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help=".jsonl[.gz] / .json / .parquet files, or Hugging Face dataset names NAME[:SPLIT]")
    parser.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    parser.add_argument("--max-length", type=int, default=None, help="longest sample in tokens (default: the target's max_position_embeddings)")
    parser.add_argument("--overlong", choices=("truncate", "drop"), default="truncate", help="longer samples: keep the head, or skip them (counted)")
    parser.add_argument("--heldout", type=int, default=0, metavar="N", help="conversations set aside as evaluation prompts (default 0)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizing processes (default: cores - 1)")
    parser.add_argument("--thinking", choices=sorted(_THINKING), default=None, help="enable_thinking for templates that have it")
    parser.add_argument("--strict", action="store_true", help="stop at the first record that would be skipped, naming file and line")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out selection")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")


def run(args: argparse.Namespace) -> int:
    config = PrepareConfig(
        target=args.target, inputs=list(args.input), out=args.out, max_length=args.max_length, overlong=args.overlong,
        heldout=args.heldout, workers=args.workers, thinking=_THINKING.get(args.thinking), strict=args.strict,
        seed=args.seed, overwrite=args.overwrite,
    )
    meta = prepare(config)
    if args.thinking and not meta["tokenizer"]["template_has_thinking"]:
        print(f"note: the chat template has no enable_thinking; --thinking {args.thinking} changed nothing")
    print(f"wrote {args.out}")
    for line in format_stats(meta):
        print("  " + line)
    return 0
