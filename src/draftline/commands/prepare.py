"""``draftline prepare --target DIR --input FILE... --out DATA_DIR``: conversations to a token dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.cores import usable_cores
from draftline.data.prepare import PrepareConfig, format_stats, prepare

_THINKING = {"on": True, "off": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("inputs and output")
    io.add_argument("--target", type=Path, required=True, metavar="DIR",
                    help="the target model directory: its tokenizer and chat template render the conversations, "
                         "its config.json gives the default --max-length")
    io.add_argument("--input", nargs="+", required=True, metavar="FILE",
                    help="conversations: .jsonl[.gz] / .json / .parquet files (OpenAI messages, ShareGPT "
                         "conversations, or input_ids + loss_mask), or Hugging Face dataset names NAME[:SPLIT]")
    io.add_argument("--out", type=Path, required=True, metavar="DIR",
                    help="the dataset directory to write: what `draftline train --data` reads")
    io.add_argument("--overwrite", action="store_true",
                    help="replace a dataset already in --out (without it an existing one is refused, not touched)")
    samples = parser.add_argument_group("samples")
    samples.add_argument("--max-length", type=int, default=None, metavar="TOKENS",
                         help="the longest sample, in tokens; use train's --token-budget or less, since a batch "
                              "holds whole samples (default: the target's max_position_embeddings)")
    samples.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                         help="what happens to a longer sample: truncate keeps its first --max-length tokens, drop "
                              "skips it (counted in the statistics; default: truncate)")
    samples.add_argument("--heldout", type=int, default=0, metavar="N",
                         help="conversations set aside, not trained on, as the prompts train measures acceptance "
                              "on (train's --eval-num-prompts uses the first ones; default 0: none)")
    samples.add_argument("--seed", type=int, default=0, metavar="N",
                         help="seed of which conversations are held out (default 0)")
    samples.add_argument("--thinking", choices=sorted(_THINKING), default=None,
                         help="enable_thinking passed to chat templates that have it (Qwen3): on or off; default: "
                              "the template's own default")
    samples.add_argument("--strict", action="store_true",
                         help="stop at the first record that would be skipped, naming its file and line (default: "
                              "skip it and count it by reason)")
    parser.add_argument("--workers", type=int, default=max(1, usable_cores() - 1), metavar="N",
                        help="tokenizing processes run in parallel (default: this machine's cores - 1)")


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
