"""How long drafters wait for each other at a step's all-reduce, from the data order alone (CPU).

    python bench/step_balance.py                      # the bench's 8B length mix, 32K budget
    python bench/step_balance.py --drafters 2 4 8 --drafter-share 2.0

Each drafter trains one batch of the step; a rank's time is its target's work (~ the batch's
tokens) plus its drafter's (~ the batch's anchors: per document up to --max-anchors), the drafter's
being --drafter-share times the target's per batch on average. Per-GPU efficiency is the mean over
steps of mean / max rank time. Compares the batcher's plain shuffle with steps of similar work.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher  # noqa: E402


def efficiency(lengths, budget, drafters, step_batches, max_anchors, share) -> tuple[float, float]:
    """(per-GPU efficiency, mean over steps of largest/mean anchors - 1) with one batch per drafter per step."""
    batcher = TokenBudgetBatcher(lengths, budget, 64, seed=0, step_batches=step_batches, max_anchors=max_anchors)
    seqs = list(BatchSchedule(batcher, 1).batches())
    tokens = np.array([lengths[s.sample_indices].sum() for s in seqs], float)
    anchors = np.array([batcher.anchors(s.sample_indices) for s in seqs], float)
    cost = tokens / tokens.mean() + share * anchors / anchors.mean()
    n = len(cost) // drafters * drafters
    steps, work = cost[:n].reshape(-1, drafters), anchors[:n].reshape(-1, drafters)
    return float((steps.mean(1) / steps.max(1)).mean()), float((work.max(1) / work.mean(1) - 1).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--drafter-share", type=float, default=2.0, help="drafter work / target work per batch")
    parser.add_argument("--samples", type=int, default=40000)
    parser.add_argument("--mean-length", type=float, default=2826)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sigma = 0.6
    lengths = np.clip(rng.lognormal(math.log(args.mean_length) - sigma**2 / 2, sigma, args.samples), 64, 8192)
    lengths = lengths.astype(np.int64)
    print(f"{'drafters':>8s} {'plain':>8s} {'balanced':>9s}  {'anchor imbalance plain -> balanced':s}")
    for k in args.drafters:
        plain, plain_gap = efficiency(lengths, args.budget, k, 1, args.max_anchors, args.drafter_share)
        balanced, balanced_gap = efficiency(lengths, args.budget, k, k, args.max_anchors, args.drafter_share)
        print(f"{k:8d} {plain:8.1%} {balanced:9.1%}  {plain_gap:.3f} -> {balanced_gap:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
