"""Planning a topology: how many GPUs should run the target, how many the drafter.

The two sides must move the same number of samples per second: with ``T`` target GPUs at ``r_t``
samples/s each and ``D`` drafter GPUs at ``r_d``, the line runs at ``min(T r_t, D r_d)`` and the
faster side waits for the rest. ``estimate_rates`` gets ``r_t``/``r_d`` from the FLOP model at an
assumed MFU (no GPU needed); ``measure_rates`` times the real roles on this device. ``splits``
tabulates every split of ``N`` GPUs, best first; ``colocated_rate`` is the alternative of a target
and a drafter on every GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from draftline.data.batch import PackedBatch
from draftline.monitor.flops import DrafterShape, TargetShape, drafter_flops, target_flops


@dataclass
class RoleRates:
    target_samples_s: float  # per target GPU
    drafter_samples_s: float  # per drafter GPU
    source: str
    target_peak_gib: float | None = None
    drafter_peak_gib: float | None = None


@dataclass
class Split:
    targets: int
    drafters: int
    samples_s: float
    waiting_side: str  # "targets", "drafters" or "none"
    waiting_share: float  # fraction of time the waiting side's GPUs idle


def splits(num_gpus: int, rates: RoleRates) -> list[Split]:
    """Every T + D = num_gpus split (each >= 1), best throughput first."""
    out = []
    for targets in range(1, num_gpus):
        drafters = num_gpus - targets
        produce = targets * rates.target_samples_s
        consume = drafters * rates.drafter_samples_s
        speed = min(produce, consume)
        if abs(produce - consume) <= 1e-9 * max(produce, consume):
            side, share = "none", 0.0
        elif produce > consume:
            side, share = "targets", 1 - consume / produce
        else:
            side, share = "drafters", 1 - produce / consume
        out.append(Split(targets, drafters, speed, side, share))
    return sorted(out, key=lambda s: -s.samples_s)


def colocated_rate(num_gpus: int, rates: RoleRates) -> float:
    """Samples/s with a target and a drafter on every GPU (``--colocated``): each GPU does both
    jobs in turn. In this model it equals a perfectly balanced split and beats an unbalanced one;
    what it costs instead is memory (both on one GPU) and the per-step gradient all-reduce."""
    return num_gpus / (1.0 / rates.target_samples_s + 1.0 / rates.drafter_samples_s)


def per_sample_flops(target_shape: TargetShape, drafter_shape: DrafterShape, lengths: np.ndarray,
                     max_anchors: int, prompt_share: float = 0.2) -> tuple[float, float]:
    """Mean target and drafter FLOPs per sample over ``lengths`` (anchors in the response part)."""
    t_total, d_total = 0.0, 0.0
    block = drafter_shape.block_size
    for n in lengths.tolist():
        t_total += target_flops(target_shape, [n], drafter_shape.target_layers_run)
        start = int(n * prompt_share)
        eligible = max(0, n - start - 1)
        anchors = min(max_anchors, eligible)
        positions = np.linspace(start, n - 2, anchors).round().astype(int) if anchors else np.zeros(0, int)
        d_total += drafter_flops(drafter_shape, num_context_rows=n, anchor_positions=torch.from_numpy(positions),
                                 num_labelled_rows=anchors * (block - 1))
    return t_total / len(lengths), d_total / len(lengths)


def estimate_rates(target_shape: TargetShape, drafter_shape: DrafterShape, lengths: np.ndarray, max_anchors: int,
                   peak_flops: float, target_mfu: float = 0.5, drafter_mfu: float = 0.4) -> RoleRates:
    """Rates from the FLOP model at assumed MFUs (what the roles reach here is in docs/PERF_NOTES.md)."""
    t, d = per_sample_flops(target_shape, drafter_shape, lengths, max_anchors)
    return RoleRates(target_mfu * peak_flops / t, drafter_mfu * peak_flops / d,
                     f"FLOP model at {target_mfu:.0%} target / {drafter_mfu:.0%} drafter MFU")


def _batches(lengths: np.ndarray, budget: int, vocab: int, count: int, seed: int = 0) -> list[PackedBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        docs, total = [], 0
        for n in rng.choice(lengths, size=len(lengths)):
            n = int(min(n, budget))
            if total + n > budget:
                break
            ids = rng.integers(0, vocab - 1, n).tolist()
            docs.append((ids, [i >= n // 5 for i in range(n)]))
            total += n
        out.append(PackedBatch.from_documents(docs or [([1] * budget, [True] * budget)],
                                              sample_ids=list(range(len(docs) or 1)), index=index))
    return out


def _timed(device: torch.device, fn, warmup: int, batches: list) -> tuple[float, int, float | None]:
    for b in batches[:warmup]:
        fn(b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    samples = 0
    for b in batches[warmup:]:
        fn(b)
        samples += b.num_docs
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return time.perf_counter() - start, samples, peak


def measure_rates(target, worker, lengths: np.ndarray, budget: int, device: torch.device,
                  iters: int = 3, warmup: int = 1) -> RoleRates:
    """Time the target's feature pass and the drafter's training step on batches like the data's."""
    from draftline.pipeline.transport import Delivery

    vocab = target.embed_weight().shape[0]
    batches = _batches(lengths, budget, vocab, iters + warmup)
    features = {}

    def run_target(batch):
        features[batch.index] = target(batch)

    t_wall, t_samples, t_peak = _timed(device, run_target, warmup, batches)

    def run_drafter(batch):
        worker.train_on(Delivery(batch.index, features[batch.index], batch))
        worker.finish_step()

    d_wall, d_samples, d_peak = _timed(device, run_drafter, warmup, batches)
    return RoleRates(t_samples / t_wall, d_samples / d_wall, f"measured on {device}", t_peak, d_peak)
