"""``draftline regenerate --target DIR --input FILE --out FILE``: assistant turns from the target itself.

Locally (batched ``generate``, GPU when there is one) or through an OpenAI-compatible server
(``--endpoint``). Rerunning the same command after an interruption continues where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftline.data.regenerate import regenerate
from draftline.errors import DraftlineError

_THINKING = {"on": True, "off": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=None, help="target model directory (required without --endpoint)")
    parser.add_argument("--input", required=True, help="conversations: .jsonl[.gz] / .json / .parquet (messages or conversations)")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL (appended to: rerun to resume)")
    parser.add_argument("--endpoint", default=None, help="OpenAI-compatible server, e.g. http://localhost:8000/v1")
    parser.add_argument("--model", default=None, help="model name the server serves (default: --target as given)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight with --endpoint (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="longest reply in tokens (default 2048)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    parser.add_argument("--batch-size", type=int, default=16, help="conversations per local generate call (default 16)")
    parser.add_argument("--thinking", choices=sorted(_THINKING), default=None, help="enable_thinking for templates that have it")
    parser.add_argument("--limit", type=int, default=None, help="only the first N records of the input")
    parser.add_argument("--retries", type=int, default=3, help="retries per request on 429/5xx/connection errors (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (local generation)")


def run(args: argparse.Namespace) -> int:
    thinking = _THINKING.get(args.thinking)
    if args.endpoint:
        from draftline.data.generate import EndpointGenerator

        model = args.model or (str(args.target) if args.target else None)
        if model is None:
            raise DraftlineError("--endpoint needs --model NAME (the name the server serves) or --target")
        generator = EndpointGenerator(args.endpoint, model, concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, thinking=thinking, retries=args.retries)
        group_size = 4 * args.concurrency
        print(f"regenerating through {generator.url} (model {model}, {args.concurrency} in flight)")
    else:
        if args.target is None:
            raise DraftlineError("--target DIR is required for local generation (or pass --endpoint URL)")
        from draftline.data.generate import LocalGenerator

        generator = LocalGenerator(args.target, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   batch_size=args.batch_size, thinking=thinking, seed=args.seed)
        group_size = args.batch_size
        print(f"regenerating with {args.target} on {generator.device} (batch {args.batch_size})")
    try:
        stats = regenerate(args.input, args.out, generator, group_size=group_size, limit=args.limit)
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished records are in {args.out}: rerun the same command to continue")
        return 130
    finally:
        generator.close()
    print(f"wrote {args.out}: {stats['regenerated']:,} regenerated now, {stats['already_done']:,} from before, "
          f"{stats['failed']:,} failed ({stats['seconds']:.0f} s)")
    if stats["cut_by_max_new_tokens"]:
        print(f"  {stats['cut_by_max_new_tokens']:,} replies hit --max-new-tokens {args.max_new_tokens} (kept, without their end)")
    if stats["failed"]:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in sorted(stats["failure_kinds"].items()))
        print(f"  failed: {kinds}; records and reasons in {stats['failed_file']} (rerun to retry them)")
    return 0
