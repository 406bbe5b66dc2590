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
    io = parser.add_argument_group("inputs and output")
    io.add_argument("--input", required=True, metavar="FILE",
                    help="conversations whose assistant turns are replaced: .jsonl[.gz] / .json / .parquet "
                         "(OpenAI messages or ShareGPT conversations)")
    io.add_argument("--out", type=Path, required=True, metavar="FILE",
                    help="output JSONL, appended to: rerun the same command after an interruption to continue "
                         "(nothing is redone or duplicated); failures go to OUT.failed.jsonl with the reason")
    io.add_argument("--limit", type=int, default=None, metavar="N",
                    help="regenerate only the first N records of --input (a trial; default: all)")
    io.add_argument("--max-minutes", type=float, default=None, metavar="MINUTES",
                    help="start no new group of records after this many minutes (a job with a time slot); what "
                         "is written is kept and the same command continues it (default: no limit)")
    where = parser.add_argument_group("where the target runs")
    where.add_argument("--target", type=Path, default=None, metavar="DIR",
                       help="the target model directory, to generate locally (GPU if there is one); required "
                            "without --endpoint")
    where.add_argument("--endpoint", default=None, metavar="URL",
                       help="an OpenAI-compatible server serving the target instead, e.g. "
                            "http://localhost:8000/v1 (vLLM, SGLang): much faster for a large target")
    where.add_argument("--model", default=None, metavar="NAME",
                       help="with --endpoint: the model name the server serves (default: --target as given)")
    where.add_argument("--concurrency", type=int, default=16, metavar="REQUESTS",
                       help="with --endpoint: requests in flight at once; raise it until the server is busy "
                            "(default 16)")
    where.add_argument("--retries", type=int, default=3, metavar="N",
                       help="with --endpoint: retries per request on 429/5xx/connection errors, with backoff "
                            "(default 3)")
    where.add_argument("--batch-size", type=int, default=16, metavar="CONVERSATIONS",
                       help="locally: conversations per batched generate call; lower it if generation runs out "
                            "of memory (default 16)")
    where.add_argument("--workers", type=int, default=1, metavar="PROCESSES",
                       help="locally: processes generating at once, each on its own GPU (cuda:0, cuda:1, ...) or, "
                            "without GPUs, on its share of the CPU cores; for several GPUs: on a CPU one process's "
                            "threads did as well or better (default 1)")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=2048, metavar="TOKENS",
                     help="the longest reply, in tokens; a longer one is cut there (default 2048)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="sampling temperature; 0 = greedy (default), the replies a greedy server would give")
    gen.add_argument("--thinking", choices=sorted(_THINKING), default=None,
                     help="enable_thinking passed to chat templates that have it (Qwen3): on or off; default: "
                          "the template's own default")
    gen.add_argument("--seed", type=int, default=0, metavar="N",
                     help="seed of the sampling in local generation with --temperature > 0 (default 0)")


def run(args: argparse.Namespace) -> int:
    thinking = _THINKING.get(args.thinking)
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise DraftlineError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.workers < 1:
        raise DraftlineError(f"--workers must be >= 1, got {args.workers}")
    if args.endpoint and args.workers > 1:
        raise DraftlineError("--workers is for local generation; with --endpoint the server batches the requests "
                             "(raise --concurrency instead)")
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
        options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "batch_size": args.batch_size, "thinking": thinking, "seed": args.seed}
        if args.workers > 1:
            from draftline.data.generate_pool import GeneratorPool

            generator = GeneratorPool(args.target, args.workers, **options)
        else:
            from draftline.data.generate import LocalGenerator

            generator = LocalGenerator(args.target, **options)
        group_size = args.batch_size * args.workers
        print(f"regenerating with {args.target} on {generator.device} (batch {args.batch_size})")
    try:
        stats = regenerate(args.input, args.out, generator, group_size=group_size, limit=args.limit,
                           max_seconds=None if args.max_minutes is None else args.max_minutes * 60)
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished records are in {args.out}: rerun the same command to continue")
        return 130
    finally:
        generator.close()
    print(f"wrote {args.out}: {stats['regenerated']:,} regenerated now, {stats['already_done']:,} from before, "
          f"{stats['failed']:,} failed ({stats['seconds']:.0f} s)")
    if stats["time_up"]:
        print(f"  stopped after {args.max_minutes:g} minutes (--max-minutes): rerun the same command to continue")
    if stats["cut_by_max_new_tokens"]:
        print(f"  {stats['cut_by_max_new_tokens']:,} replies hit --max-new-tokens {args.max_new_tokens} (kept, without their end)")
    if stats["failed"]:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in sorted(stats["failure_kinds"].items()))
        print(f"  failed: {kinds}; records and reasons in {stats['failed_file']} (rerun to retry them)")
    return 0
