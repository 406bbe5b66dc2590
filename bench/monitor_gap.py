"""Why a small monitor sample reads a different tau than `draftline eval`: prompt sample vs token cut.

    python bench/monitor_gap.py RUN_DIR [--prompts 24] [--out gap.json]

Decodes every one of the demo's first ``--prompts`` held-out prompts, one at a time, with the run's
final drafter (``RUN_DIR/final``, bf16 as `draftline eval` loads it) and its last fp32 checkpoint (what
the monitor measures), at 32 and 64 new tokens. From the per-prompt acceptance it prints, for n
prompts: tau of the first n (what the monitor measures), and the mean and standard deviation over 200
random n-prompt subsets of the ``--prompts`` (how much a sample of n varies).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch


def _tau(hists: list[list[int]], idx) -> float:
    tokens = sum(sum((k + 1) * c for k, c in enumerate(hists[i])) for i in idx)
    steps = sum(sum(hists[i]) for i in idx)
    return tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", default="32,64")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from draftline.checkpoint.export import load_drafter
    from draftline.demo.pipeline import HELDOUT_PROMPTS, TARGET
    from draftline.evaluate.acceptance import measure_acceptance
    from draftline.evaluate.prompts import read_prompts

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompts = read_prompts(str(HELDOUT_PROMPTS), str(TARGET), limit=args.prompts)
    checkpoint = sorted((args.run_dir / "checkpoints").glob("step-*"))[-1] / "drafter"
    rng = random.Random(0)
    rows = []
    for name, path in (("final (bf16)", args.run_dir / "final"), ("checkpoint (fp32)", checkpoint)):
        drafter = load_drafter(path, device="cpu", dtype=torch.float32).eval()
        for tokens in map(int, args.tokens.split(",")):
            with torch.no_grad():
                hists = [measure_acceptance(target, drafter, [p], max_new_tokens=tokens)["acceptance_hist"]
                         for p in prompts]
            for n in sorted({4, 8, 12, args.prompts}):
                sample = [_tau(hists, rng.sample(range(len(prompts)), n)) for _ in range(200)]
                mean = sum(sample) / len(sample)
                sd = (sum((x - mean) ** 2 for x in sample) / len(sample)) ** 0.5
                row = {"drafter": name, "prompts": n, "tokens": tokens, "first_n": _tau(hists, range(n)),
                       "random_mean": mean, "random_sd": sd}
                rows.append(row)
                print(f"{name:<18} {n:>3} prompts x {tokens:>3} tokens: first {n} {row['first_n']:.3f}   "
                      f"random {n}: {mean:.3f} +- {sd:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
