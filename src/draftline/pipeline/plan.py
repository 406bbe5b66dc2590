"""Planning a topology: how many GPUs should run the target, how many the drafter, at what budget.

The two sides must move the same number of samples per second: with ``T`` target GPUs at ``r_t``
samples/s each and ``D`` drafter GPUs at ``r_d``, the line runs at ``min(T r_t, D r_d)`` and the
faster side waits for the rest. ``estimate_rates`` gets ``r_t``/``r_d`` from the FLOP model (each
layer by its kind) at an assumed MFU of a given peak (no GPU needed, any GPU: its peak and memory
are inputs); ``measure_rates`` times the real roles on this device. ``splits`` tabulates every
split of ``N`` GPUs, best first; ``colocated_rate`` is the alternative of a target and a drafter on
every GPU. ``target_memory``/``drafter_memory`` estimate each role's memory (weights, optimizer,
activations, queued features) so the plan can say which token budget fits a GPU of a given size;
``train``'s preflight then checks the real worst case on the real device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from draftline.data.batch import PackedBatch
from draftline.monitor.flops import DecoderShape, DrafterShape, TargetShape, drafter_flops, target_flops

_GIB = 2**30
# Assumed MFUs against the spec peak, from what the roles reach on an H200 (docs/PERF_NOTES.md):
# the dense target's feature pass ~40%, the drafter's training step ~32%.
TARGET_MFU, DRAFTER_MFU = 0.40, 0.32


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


def target_share(model, config, device=None) -> float:
    """The target's share of the work per sample of the reference workload, to balance ``train``'s default
    split (the rate model ``plan`` uses)."""
    from draftline.monitor.reference import reference_drafter_flops, reference_target_flops

    t = reference_target_flops(model.target_shape, model.layers_run)
    d = reference_drafter_flops(model.drafter_shape, num_anchors=config.data.max_anchors)
    return t / (t + d)


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
                   peak_flops: float, target_mfu: float = TARGET_MFU, drafter_mfu: float = DRAFTER_MFU) -> RoleRates:
    """Rates from the FLOP model at assumed MFUs of ``peak_flops`` (the GPU's spec peak)."""
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
        worker.read_record()  # the step before's, one step late as in training
        worker.queue_update()

    d_wall, d_samples, d_peak = _timed(device, run_drafter, warmup, batches)
    worker.read_record()
    return RoleRates(t_samples / t_wall, d_samples / d_wall, f"measured on {device}", t_peak, d_peak)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    """One role's memory on one GPU, in GiB."""

    weights: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.activations + self.buffers

    def describe(self) -> str:
        return (f"{self.total:.1f} GiB (weights {self.weights:.1f}, optimizer {self.optimizer:.1f}, "
                f"activations {self.activations:.1f}, queued features {self.buffers:.1f})")


def _widest(shape: DecoderShape) -> float:
    """Columns a token's row fans out to in the widest layer (projection outputs + inputs): about
    its per-token weights over the width, plus a few residual-width tensors."""
    return max(layer.token_params / shape.hidden_size for layer in shape.layers) + 4 * shape.hidden_size


def target_memory(shape: DecoderShape, layers_run: int, token_budget: int, num_feature_layers: int,
                  queued_batches: int, bytes_per_value: int = 2) -> MemoryEstimate:
    """The frozen target: its layers up to ``layers_run`` (every MoE expert), embedding and head in
    bf16; forward activations of the widest layer over ``token_budget`` tokens; the features of
    ``queued_batches`` batches waiting to be sent (K feature layers + the one being built)."""
    run = shape.with_layers_run(layers_run)
    weights = run.params() * bytes_per_value
    activations = token_budget * _widest(run) * bytes_per_value
    features = (queued_batches + 1) * token_budget * num_feature_layers * shape.hidden_size * bytes_per_value
    return MemoryEstimate(weights / _GIB, 0.0, activations / _GIB, features / _GIB)


def drafter_memory(shape: DrafterShape, token_budget: int, max_query_rows: int, queued_batches: int,
                   bytes_per_value: int = 2) -> MemoryEstimate:
    """The drafter: fp32 master weights and gradients, AdamW's two fp32 moments (16 bytes per
    trained weight), the frozen embedding and head in bf16; activations kept for backward over
    ``max_query_rows`` block rows (each layer's linear inputs and outputs, counted twice for the
    fp32 softmax/norm intermediates and the recomputed head chunks) and over the ``token_budget``
    context rows (features, ``fc`` output, each layer's k and v); received feature batches."""
    hidden = shape.hidden_size
    features_width = len(shape.target_layer_ids) * hidden
    trained = sum(layer.token_params for layer in shape.layers) + features_width * hidden
    frozen = 2 * shape.vocab_size * hidden * bytes_per_value
    per_row = 2 * sum(layer.token_params / hidden + 6 * hidden for layer in shape.layers) * bytes_per_value
    per_context = (features_width + hidden + sum(layer.kv_width for layer in shape.layers)) * bytes_per_value
    activations = max_query_rows * per_row + token_budget * per_context
    features = queued_batches * token_budget * features_width * bytes_per_value
    return MemoryEstimate((8 * trained + frozen) / _GIB, 8 * trained / _GIB, activations / _GIB, features / _GIB)


def largest_budget(fits: Callable[[int], bool], upper: int = 131072, step: int = 4096) -> int | None:
    """The largest multiple of ``step`` up to ``upper`` for which ``fits`` holds (memory grows with it)."""
    best = None
    for budget in range(step, upper + 1, step):
        if not fits(budget):
            break
        best = budget
    return best
