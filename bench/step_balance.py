"""How long drafters wait for each other at a step's all-reduce, from the data order alone (CPU).

    python bench/step_balance.py                      # the bench's 8B length mix, 32K budget
    python bench/step_balance.py --drafters 2 4 8 --drafter-share 2.0
    python bench/step_balance.py --data DATA --target TARGET --budget 1024 --max-anchors 16   # measured

With ``--data`` (a prepared dataset) and ``--target`` (its target's directory, for the drafter's
shape), each batch of the first epoch is trained once by a drafter on this machine and timed; the
steps' waits then come from those times instead of the model.

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


def measured_times(args):
    """Seconds of one drafter step per batch of epoch 0 (plain order), the batches' sample tuples -> index, and the
    dataset."""
    import time

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import make_worker, train_step

    from draftline.data.dataset import TokenDataset
    from draftline.model.config import build_drafter_config
    from draftline.model.target import load_target_config
    from draftline.pipeline.transport import Delivery

    dataset = TokenDataset(args.data)
    batcher = TokenBudgetBatcher(dataset.lengths, args.budget, 64, seed=0)
    cfg = build_drafter_config(load_target_config(args.target), num_hidden_layers=args.draft_layers,
                               block_size=args.block_size, target_layer_ids=args.target_layer_ids)
    device, dtype = torch.device(args.device), torch.float32
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    worker = make_worker(cfg, device, dtype, 32768, embed, head, compile_layers=False)
    worker.objective.settings.max_anchors = args.max_anchors
    width = len(cfg.dflash_config["target_layer_ids"]) * cfg.hidden_size
    batches = batcher.epoch_batches(0)[: args.max_batches]
    times = []
    for i, indices in enumerate([batches[0], *batches]):  # the first once more: warm-up
        batch = dataset.packed_batch(indices, 0, i)
        delivery = Delivery(i, torch.randn(batch.num_tokens, width, dtype=dtype), batch)
        start = time.perf_counter()
        train_step(worker, delivery)
        times.append(time.perf_counter() - start)
    return np.array(times[1:]), {tuple(sorted(b.tolist())): i for i, b in enumerate(batches)}, dataset


def measured(args) -> None:
    times, index, dataset = measured_times(args)
    print(f"{len(times)} batches timed: {1e3 * times.mean():.0f} ms mean, {1e3 * times.min():.0f}-{1e3 * times.max():.0f} ms")
    print(f"{'drafters':>8s} {'plain':>8s} {'by length':>10s} {'by anchors':>11s}   "
          "(measured step times; per-GPU efficiency from the wait)")
    for k in args.drafters:
        out = []
        for step_batches, positions in ((1, None), (k, None), (k, dataset.anchor_positions())):
            batcher = TokenBudgetBatcher(dataset.lengths, args.budget, 64, seed=0, step_batches=step_batches,
                                         max_anchors=args.max_anchors, anchor_positions=positions)
            order = [index.get(tuple(sorted(b.tolist()))) for b in batcher.epoch_batches(0)]
            t = np.array([times[i] if i is not None else np.nan for i in order])
            n = len(t) // k * k
            steps = t[:n].reshape(-1, k)
            steps = steps[~np.isnan(steps).any(1)]  # steps with a batch past --max-batches are left out
            out.append((steps.mean(1) / steps.max(1)).mean())
        print(f"{k:8d} {out[0]:8.1%} {out[1]:10.1%} {out[2]:11.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--drafter-share", type=float, default=2.0, help="drafter work / target work per batch")
    parser.add_argument("--samples", type=int, default=40000)
    parser.add_argument("--mean-length", type=float, default=2826)
    parser.add_argument("--data", type=Path, help="a prepared dataset: time each batch instead of the model")
    parser.add_argument("--target", type=Path, help="with --data: the target's directory (the drafter's shape)")
    parser.add_argument("--draft-layers", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--target-layer-ids", type=lambda t: [int(x) for x in t.split(",")], default=None)
    parser.add_argument("--max-batches", type=int, default=400)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.data:
        measured(args)
        return 0
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
