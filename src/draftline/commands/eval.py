"""``draftline eval``: speculative decoding with a drafter; acceptance length and, on a GPU, speedup."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftline.errors import DraftlineError

_THINKING = {"on": True, "off": False}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("inputs and output")
    io.add_argument("--target", type=Path, required=True, metavar="DIR",
                    help="the target model directory (Hugging Face format) the drafter was trained for")
    io.add_argument("--drafter", type=Path, required=True, metavar="DIR",
                    help="a drafter directory, a training checkpoint, or a run directory (its final/, else its "
                         "latest checkpoint)")
    io.add_argument("--prompts", type=Path, required=True, metavar="FILE",
                    help="JSONL, one prompt per line: input_ids, or messages (rendered with the target's chat "
                         "template), e.g. the heldout.jsonl of a prepared dataset")
    io.add_argument("--limit", type=int, default=None, metavar="N",
                    help="use only the first N prompts (a quicker, noisier figure; default: all)")
    io.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="also write the summary and per-prompt outputs (output_ids, acceptance_lengths) to FILE")
    dec = parser.add_argument_group("decoding")
    dec.add_argument("--max-new-tokens", type=int, default=256, metavar="TOKENS",
                     help="tokens generated per prompt at most (default 256)")
    dec.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                     help="tokens per draft block (>= 2), e.g. to measure how a smaller block than trained "
                          "accepts (default: the drafter's own; a DSpark drafter drafts from its own only)")
    dec.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 = greedy (default: tau as servers quote it); above 0 samples, verified with "
                          "rejection sampling")
    dec.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="with --temperature > 0: nucleus sampling mass, 0..1 (default 1 = off)")
    dec.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="with --temperature > 0: sample among the K most likely tokens (default 0 = off)")
    dec.add_argument("--seed", type=int, default=0, metavar="N",
                     help="seed of the sampler with --temperature > 0 (default 0)")
    dec.add_argument("--stop-token-ids", default=None, metavar="ID,ID,...",
                     help="comma-separated token ids that end a generation (default: the target's eos; 'none' "
                          "to always generate --max-new-tokens)")
    dec.add_argument("--thinking", choices=sorted(_THINKING), default=None,
                     help="enable_thinking passed to chat templates that have it (Qwen3): on or off; default: "
                          "the template's own default")
    dev = parser.add_argument_group("device")
    dev.add_argument("--device", default="auto", metavar="DEVICE",
                     help="auto (CUDA if available, default), cuda, cuda:N or cpu")
    dev.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                     help="weights and compute dtype of target and drafter (default bfloat16 on GPU, float32 on CPU)")
    dev.add_argument("--target-fp8", action="store_true",
                     help="the target's decoder linear layers in FP8, as train's --target-fp8 runs them (e4m3 weights "
                          "scaled per output channel, activations per row): measure a drafter against the target as "
                          "an engine serving it in FP8 computes it")
    dev.add_argument("--no-speedup", action="store_true",
                     help="on a GPU, skip the target-only baseline run that the wall-clock speedup is measured "
                          "against (a shorter eval; tau is measured either way)")


def _stop_ids(text: str | None, target) -> list[int]:
    from draftline.evaluate.acceptance import eos_token_ids

    if text is None:
        return eos_token_ids(target)
    if text.strip().lower() == "none":
        return []
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DraftlineError(f"--stop-token-ids takes comma-separated integers or 'none', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from transformers import AutoModelForCausalLM

    from draftline.checkpoint.export import load_drafter, load_drafter_config
    from draftline.checkpoint.locate import find_drafter_dir
    from draftline.checkpoint.serving import inspect_drafter_dir
    from draftline.evaluate.acceptance import format_summary
    from draftline.evaluate.benchmark import evaluate_prompts
    from draftline.evaluate.prompts import read_prompts
    from draftline.evaluate.sampling import Sampling
    from draftline.methods import method_for
    from draftline.model.config import check_matches_target
    from draftline.model.target import convert_to_fp8, load_target_config

    # ---- check everything cheap before loading weights
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.max_new_tokens < 1:
        raise DraftlineError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise DraftlineError(f"--limit must be >= 1, got {args.limit}")
    drafter_dir = find_drafter_dir(args.drafter)
    drafter_config = load_drafter_config(drafter_dir)
    check_matches_target(drafter_config, load_target_config(args.target))
    # The serving check: a drafter for another target is refused; what only the engines would load
    # differently is said (eval decodes it as draftline trained it; `draftline export` refuses it).
    serving = inspect_drafter_dir(drafter_dir, args.target)
    serving.raise_if_refused(kinds=("target",))
    for finding in serving.refused(kinds=("serving",)):
        print(f"warning: vLLM/SGLang would not serve this drafter as evaluated (export refuses it): {finding}")
    for warning in serving.warnings:
        print(f"warning: {warning}")
    method = method_for(drafter_config)
    if args.block_size is not None and not method.decodes_other_blocks:
        raise DraftlineError(f"--block-size: this {method.name} drafter drafts from its training block of "
                             f"{drafter_config.block_size} only (each slot's draft depends on the whole block); drop "
                             "--block-size")
    block_size = args.block_size or int(drafter_config.block_size)
    if block_size < 2:
        raise DraftlineError(f"--block-size must be >= 2 (the anchor and at least one draft), got {block_size}")
    prompts = read_prompts(args.prompts, args.target, limit=args.limit, thinking=_THINKING.get(args.thinking))

    # ---- models
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    if args.target_fp8:
        convert_to_fp8(target)  # before the move: the device never holds the full-precision weights
    target = target.to(device).eval()
    drafter = load_drafter(drafter_dir, device=device, dtype=dtype)
    proposer = method.proposer(drafter, target)
    stop_ids = _stop_ids(args.stop_token_ids, target)
    drafts = method.drafts_per_block(block_size)
    print(f"draftline eval: {len(prompts)} prompts, {method.describe(drafter_config)} drafter {drafter_dir}, block "
          f"size {block_size} ({drafts} drafts per step), "
          f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature} top-p {sampling.top_p} top-k {sampling.top_k}'}, "
          f"up to {args.max_new_tokens} new tokens, stop tokens {stop_ids or 'none'}, {device.type} {str(dtype).removeprefix('torch.')}")

    # ---- decode
    committed = [0, 0]  # tokens, steps: tau so far for the progress bar
    columns = [TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("tau {task.fields[tau]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    with Progress(*columns) as progress:
        task = progress.add_task("decode", total=len(prompts), tau="-")

        def on_prompt(_index, generation):
            committed[0] += sum(generation.acceptance_lengths)
            committed[1] += len(generation.acceptance_lengths)
            progress.update(task, advance=1, tau=f"{committed[0] / max(committed[1], 1):.2f}")

        result = evaluate_prompts(
            target, proposer, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, block_size=args.block_size,
            stop_token_ids=stop_ids, seed=args.seed, measure_speedup=device.type == "cuda" and not args.no_speedup,
            on_prompt=on_prompt,
        )

    # ---- report
    for line in format_summary(result.summary):
        print(line)
    if args.json is not None:
        out = {"target": str(args.target), "drafter": str(drafter_dir), **result.to_json()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out) + "\n")
        print(f"wrote {args.json}")
    return 0
