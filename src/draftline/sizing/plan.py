"""Planning a node: every layout of N GPUs, its speed and its memory per GPU, and the best one.

One model, used by ``draftline plan`` and by ``train``'s default split (``default_split``):

- Work per sample: the FLOP counter (``flops``) over a length distribution (``workload``), for the target's
  feature pass and the drafter's training step at ``max_anchors`` anchors per document.
- Rates: work / (MFU x the GPU's spec peak). The MFUs are this repository's measurements on an H200
  (``MEASURED_MFU``), taken as the same share of another GPU's spec peak when that GPU is not in hand;
  ``plan --measure`` times the roles on the GPU in hand instead.
- Sharded drafters also move their weights and gradients each pass (FSDP2: two bf16 gathers and one
  fp32 reduce-scatter of the drafter's weights); that time overlaps the pass's compute, so a drafter's
  time per sample is the larger of the two (``Hardware.link_gbs``: the GPUs' measured or assumed
  collective bandwidth).
- Layouts: T targets + D drafters (the line runs at ``min(T r_t, D r_d)``; the faster side waits), or
  every GPU colocated (each does both in turn: ``N / (1/r_t + 1/r_d)``); a drafter's state sharded
  over the D drafters.
- Memory per GPU of each role (``memory_estimate``): weights, optimizer state, activations, queued
  features; a layout fits where the largest token budget (up to
  the one asked) and query rows fit every GPU. ``train``'s preflight then measures the real worst case.
- Target groups (``--target-parallel K``, ``target_groups``): a target split over K ranks. One rank's share of the
  model (``target_groups.rank_shape``) gives its FLOPs and its memory; the group's time per sample is that share's
  compute plus the all-reduces' time over the link (``group_rates``); a layout's target ranks are whole groups
  (T a multiple of K; colocated, N a multiple of K).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from draftline.data.batch import PackedBatch
from draftline.sizing.flops import drafter_flops, target_flops
from draftline.sizing.memory_estimate import MemoryEstimate, MemoryInputs, colocated_memory, split_memory, trained_params
from draftline.sizing.peak import gpu_spec
from draftline.sizing.shapes import LINEAR, DrafterShape, TargetShape
from draftline.model.target_parallel import TENSOR
from draftline.sizing.target_groups import GroupTraffic
from draftline.sizing.workload import PROMPT_SHARE, reference_lengths, sampled_batches

MEASURED_MFU = {
    "target": (0.589, "the compiled feature pass, Qwen3-8B shape, packed 32K tokens: 41.0 Ktok/s"),
    "target_hybrid": (0.574, "the Qwen3.6-27B-shaped hybrid feature pass (flash-linear-attention), compiled, packed "
                             "32K: 11.0 Ktok/s on an H200 held at the power cap, times 1.070, the speed-up of its Gated "
                             "DeltaNet stages compiled, measured on an H100 over the same batches"),
    "drafter": (0.552, "the drafter's step, packed 32K tokens, Qwen3-8B shape, FlashAttention-4: 129 ms/sample"),
    "target_hybrid_fp8": (0.743, "the Qwen3.6-27B-shaped hybrid feature pass with its linear layers in FP8 "
                                 "(--target-fp8), compiled, packed 32K: 13.6 Ktok/s on an H100 held at the power cap, "
                                 "times 1.121, the speed-up of its Gated DeltaNet stages compiled, measured on an H100 "
                                 "over the same batches; counted against the bf16 peak"),
}
"""MFU of each role against the spec dense bf16 peak, measured on one H200 (docs/benchmarks/2026-12-planner.md; the
hybrid target's compiled pass: docs/benchmarks/2026-12-the-card.md), the FP8 pass on an H100, whose spec peaks are
the H200's (docs/benchmarks/2026-12-target-fp8.md). The hybrid passes' later speed-up (their Gated DeltaNet stages
compiled) was measured on an H100 and applied to those figures (docs/benchmarks/2026-12-hybrid-pass-profile.md)."""

ANCHOR_SWEEP = (128, 256, 512)
"""Anchors per document at which the recommended layout is also shown (the seeds' trade)."""


@dataclass(frozen=True)
class Hardware:
    """One GPU of the node, as planning needs it."""

    name: str
    peak_flops: float
    memory_gib: float
    link_gbs: float
    """Bandwidth of a collective between the node's GPUs (NCCL bus bandwidth), GB/s."""
    link_source: str = "assumed"


@dataclass
class RoleRates:
    target_samples_s: float  # per target GPU
    drafter_samples_s: float  # per drafter GPU, its compute alone
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


# ------------------------------------------------------------------------------------------ work
def per_sample_flops(target_shape: TargetShape, drafter_shape: DrafterShape, lengths: np.ndarray,
                     max_anchors: int, prompt_share: float = PROMPT_SHARE) -> tuple[float, float]:
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


def anchors_per_sample(lengths: np.ndarray, max_anchors: int, prompt_share: float = PROMPT_SHARE) -> float:
    return float(np.mean([min(max_anchors, max(0, int(n - int(n * prompt_share) - 1))) for n in lengths.tolist()]))


def target_mfu(target_shape: TargetShape, fp8: bool = False) -> tuple[float, str]:
    """The measured MFU this target's feature pass is planned at (a hybrid's linear attention runs slower); ``fp8``:
    its linear layers in FP8, at the MFU measured so (counted against the bf16 peak), or the bf16 pass's where that
    was not measured, which the source then says."""
    key = "target_hybrid" if any(layer.kind == LINEAR for layer in target_shape.layers) else "target"
    if not fp8:
        return MEASURED_MFU[key]
    if key + "_fp8" in MEASURED_MFU:
        return MEASURED_MFU[key + "_fp8"]
    mfu, source = MEASURED_MFU[key]
    return mfu, f"{source} (bf16: FP8's pass not measured at this shape)"


def estimate_rates(target_shape: TargetShape, drafter_shape: DrafterShape, lengths: np.ndarray, max_anchors: int,
                   peak_flops: float, target_mfu_: float | None = None, drafter_mfu: float | None = None,
                   target_fp8: bool = False) -> RoleRates:
    """Rates per GPU from the FLOP model at the measured MFUs of ``peak_flops`` (the GPU's spec peak)."""
    tm = target_mfu_ if target_mfu_ is not None else target_mfu(target_shape, target_fp8)[0]
    dm = drafter_mfu if drafter_mfu is not None else MEASURED_MFU["drafter"][0]
    t, d = per_sample_flops(target_shape, drafter_shape, lengths, max_anchors)
    return RoleRates(tm * peak_flops / t, dm * peak_flops / d,
                     f"FLOP model at {tm:.1%} (target) / {dm:.1%} (drafter) of the spec peak, as measured")


# ------------------------------------------------------------------------------------------ layouts
def shard_traffic_bytes(num_trained_params: int, num_drafters: int) -> float:
    """Bytes a sharded drafter rank moves per pass: its weights gathered in bf16 for the forward and again for
    the backward, its gradients reduce-scattered in fp32; (D-1)/D of each in a ring."""
    if num_drafters <= 1:
        return 0.0
    return (2 + 2 + 4) * num_trained_params * (num_drafters - 1) / num_drafters


def drafter_seconds_per_sample(rates: RoleRates, num_drafters: int, num_trained_params: int, passes_per_sample: float,
                               hardware: Hardware) -> float:
    """One drafter GPU's time per sample: its compute, or its share of the sharded state's traffic if that is
    longer (the two overlap)."""
    compute = 1.0 / rates.drafter_samples_s
    traffic = shard_traffic_bytes(num_trained_params, num_drafters) * passes_per_sample / (hardware.link_gbs * 1e9)
    return max(compute, traffic)


def splits(num_gpus: int, rates: RoleRates, drafter_s: Callable[[int], float] | None = None) -> list[Split]:
    """Every T + D = num_gpus split (each >= 1), best throughput first; ``drafter_s(D)``: a drafter's seconds
    per sample with D drafters (default: its compute alone)."""
    out = []
    for targets in range(1, num_gpus):
        drafters = num_gpus - targets
        produce = targets * rates.target_samples_s
        consume = drafters / (drafter_s(drafters) if drafter_s else 1.0 / rates.drafter_samples_s)
        speed = min(produce, consume)
        if abs(produce - consume) <= 1e-9 * max(produce, consume):
            side, share = "none", 0.0
        elif produce > consume:
            side, share = "targets", 1 - consume / produce
        else:
            side, share = "drafters", 1 - produce / consume
        out.append(Split(targets, drafters, speed, side, share))
    return sorted(out, key=lambda s: -s.samples_s)


def group_rates(rates: RoleRates, k: int, flops_whole: float, flops_rank: float, traffic: GroupTraffic,
                mean_length: float, link_gbs: float) -> tuple[RoleRates, float]:
    """``rates`` (a whole target per GPU) for targets split over groups of ``k``: a group takes one rank's share of
    the work per sample (``flops_rank`` of ``flops_whole``) plus its all-reduces over the link (no overlap). The
    target rate returned is per GPU (the group's rate / k), so splits and the colocated rate read it as before; and
    the share of the group's time spent on the link."""
    if k == 1:
        return rates, 0.0
    compute = flops_rank / flops_whole / rates.target_samples_s
    link = traffic.seconds_per_token(link_gbs) * mean_length
    group_s = compute + link
    return replace(rates, target_samples_s=1.0 / (k * group_s)), link / group_s


def colocated_rate(num_gpus: int, rates: RoleRates, drafter_s: Callable[[int], float] | None = None) -> float:
    """Samples/s with a target and a drafter on every GPU (``--colocated``): each GPU does both jobs in turn.
    In this model it equals a perfectly balanced split and beats an unbalanced one; what it costs instead is
    memory (both on one GPU)."""
    d = drafter_s(num_gpus) if drafter_s else 1.0 / rates.drafter_samples_s
    return num_gpus / (1.0 / rates.target_samples_s + d)


# ------------------------------------------------------------------------------------------ the plan
@dataclass
class Layout:
    targets: int
    drafters: int
    colocated: bool
    samples_s: float
    ktok_s: float
    fits: bool
    token_budget: int
    max_query_rows: int
    memory_target: MemoryEstimate | None
    memory_drafter: MemoryEstimate | None
    waiting: str = ""
    target_parallel: int = 1
    """Ranks per target group (``targets`` counts their ranks)."""
    traffic: GroupTraffic | None = None
    """A target group's all-reduces per token (K > 1)."""
    link_share: float = 0.0
    """The share of a target group's time per sample spent on the link (K > 1)."""

    def name(self) -> str:
        k = self.target_parallel
        if self.colocated:
            return f"{self.targets} x colocated" + (f", targets of {k} ranks" if k > 1 else "")
        if k > 1:
            groups = self.targets // k
            return f"{groups} target{'s' if groups > 1 else ''} x {k} ranks + {self.drafters} drafters"
        return f"{self.targets} targets + {self.drafters} drafters"

    def flags(self, requested_rows: int) -> list[str]:
        flags = ["--colocated"] if self.colocated else ["--targets", str(self.targets), "--drafters", str(self.drafters)]
        if self.target_parallel > 1:
            flags += ["--target-parallel", str(self.target_parallel)]
        flags += ["--token-budget", str(self.token_budget)]
        if self.max_query_rows < requested_rows:
            flags += ["--max-query-rows", str(self.max_query_rows)]
        return flags

    def to_record(self) -> dict:
        def gib(m):
            return None if m is None else round(m.total, 2)

        memory = ({"target": gib(self.memory_target), "drafter": gib(self.memory_target)} if self.colocated
                  else {"target": gib(self.memory_target), "drafter": gib(self.memory_drafter)})
        record = {"targets": self.targets, "drafters": self.drafters, "colocated": self.colocated,
                  "ktok_s": round(self.ktok_s, 3), "fits": self.fits, "token_budget": self.token_budget,
                  "max_query_rows": self.max_query_rows, "memory_gib": memory,
                  "target_parallel": self.target_parallel}
        if self.traffic is not None and self.target_parallel > 1:
            groups = self.targets // self.target_parallel
            per_group_tokens_s = self.ktok_s * 1e3 / groups
            record["link_traffic"] = {
                "split": self.traffic.kind, "all_reduces_per_forward": self.traffic.all_reduces,
                "all_gathers_per_forward": self.traffic.gathers,
                "mb_per_token": round(self.traffic.bytes_per_token / 1e6, 4),
                "gb_s_per_gpu": round(self.traffic.bytes_per_token * per_group_tokens_s / 1e9, 3),
                "share_of_target_time": round(self.link_share, 4)}
        return record


def _largest(fits: Callable[[int], bool], upper: int, step: int, lower: int) -> int | None:
    """The largest multiple of ``step`` in [lower, upper] (``upper`` itself first) for which ``fits`` holds."""
    candidates = [upper] + list(range(upper - upper % step, lower - 1, -step))
    return next((c for c in candidates if c >= lower and fits(c)), None)


def plan_layouts(num_gpus: int, rates: RoleRates, hardware: Hardware, inputs: MemoryInputs, *, token_budget: int,
                 max_query_rows: int, mean_length: float, passes_per_sample: Callable[[int], float],
                 headroom_gib: float, min_budget: int, target_parallel: int = 1,
                 traffic: GroupTraffic | None = None, link_share: float = 0.0) -> list[Layout]:
    """Every layout of ``num_gpus`` GPUs at the largest budget and query rows that fit every GPU (up to the ones
    asked), with its memory per GPU and its rate (``passes_per_sample(rows)``: a sharded drafter's passes, each
    moving its state); best first, a layout that fits before one that does not.

    ``target_parallel`` K > 1: targets split over groups of K (``rates`` per GPU from ``group_rates``; ``inputs``
    with one rank's share of the target, ``target_groups.rank_shape``): the target ranks of a split are whole groups,
    each group's outbox on its sending rank; colocated only where K divides the GPUs."""
    k = target_parallel
    params = trained_params(inputs.drafter_shape)
    limit = hardware.memory_gib - headroom_gib

    def sized(memory_at: Callable[[int, int], float]) -> tuple[int, int] | None:
        """The largest budget whose memory fits with the rows asked, or with fewer rows (at least a head chunk)."""
        for budget in [token_budget] + list(range(token_budget - token_budget % 4096, min_budget - 1, -4096)):
            if budget < min_budget:
                continue
            rows = _largest(lambda r: memory_at(budget, r) <= limit, max_query_rows, 1024, min(4096, max_query_rows))
            if rows is not None:
                return budget, rows
        return None

    def drafter_s(drafters: int, rows: int) -> float:
        return drafter_seconds_per_sample(rates, drafters, params, passes_per_sample(rows), hardware)

    group = dict(target_parallel=k, traffic=traffic, link_share=link_share)
    layouts = []
    for targets in range(k, num_gpus, k):
        drafters = num_gpus - targets
        # the outboxes: one per target (per group's sending rank)
        size = sized(lambda b, r: max(m.total for m in split_memory(inputs, targets // k, drafters, b, r)))
        budget, rows = size or (token_budget, max_query_rows)
        split = next(s for s in splits(num_gpus, rates, lambda d: drafter_s(d, rows)) if s.targets == targets)
        target, drafter = split_memory(inputs, targets // k, drafters, budget, rows)
        wait = "balanced" if split.waiting_side == "none" else f"{split.waiting_side} idle {split.waiting_share:.0%}"
        layouts.append(Layout(targets, drafters, False, split.samples_s, split.samples_s * mean_length / 1e3,
                              size is not None, budget, rows, target, drafter, wait, **group))
    if num_gpus % k == 0:
        # A target split by its heads splits its embedding and head too: a colocated drafter then holds whole copies.
        shared = traffic is None or traffic.kind != TENSOR or k == 1
        size = sized(lambda b, r: colocated_memory(inputs, num_gpus, b, r, shared_head=shared).total)
        budget, rows = size or (token_budget, max_query_rows)
        both = colocated_rate(num_gpus, rates, lambda d: drafter_s(d, rows))
        layouts.append(Layout(num_gpus, num_gpus, True, both, both * mean_length / 1e3, size is not None, budget, rows,
                              colocated_memory(inputs, num_gpus, budget, rows, shared_head=shared), None,
                              "no side waits", **group))
    return sorted(layouts, key=lambda layout: (not layout.fits, -layout.samples_s))


def passes_per_sample(lengths: np.ndarray, max_anchors: int, block_size: int, max_query_rows: int) -> float:
    """Drafter passes per sample: its block rows over the rows of one pass (a pass holds several samples)."""
    return anchors_per_sample(lengths, max_anchors) * block_size / max_query_rows


def target_share(model, config) -> float:
    """The target's share of the time per sample on one GPU (the rates ``plan`` uses), for ``train``'s default
    split of ``--gpus N`` without ``--targets``/``--drafters``. Both rates scale with the GPU's peak, so
    the share does not depend on the GPU."""
    rates = estimate_rates(model.target_shape, model.drafter_shape, reference_lengths(), config.data.max_anchors,
                           peak_flops=1.0)
    t, d = 1.0 / rates.target_samples_s, 1.0 / rates.drafter_samples_s
    return t / (t + d)


def hardware_for(device: torch.device | None, name: str | None = None, *, memory_gib: float | None = None,
                 peak_tflops: float | None = None, link_gbs: float | None = None) -> Hardware:
    """The GPU planned for: ``name``'s spec, else this device's, else (a CPU machine) an H200's; any figure
    given overrides the spec's."""
    spec = gpu_spec(name) if name else None
    if spec is None and name is None and device is not None and device.type == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(device))
    if spec is None and name is None and peak_tflops is None:
        spec = gpu_spec("H200")
    label = spec.name if spec is not None else (name or "the given GPU")
    peak = peak_tflops * 1e12 if peak_tflops is not None else (spec.bf16_flops if spec else float("nan"))
    memory = memory_gib if memory_gib is not None else (spec.memory_gib if spec else float("nan"))
    link = link_gbs if link_gbs is not None else (spec.link_gbs if spec else 40.0)
    source = "given" if link_gbs is not None else "assumed from the GPU's interconnect"
    return Hardware(label, peak, memory, link, source)


# ------------------------------------------------------------------------------------------ measuring
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


def measure_rates(target, drafter_step: Callable[[PackedBatch, torch.Tensor], None], lengths: np.ndarray,
                  budget: int, device: torch.device, iters: int = 3, warmup: int = 1) -> RoleRates:
    """Time the target's feature pass and the drafter's training step (``drafter_step(batch, features)``: one
    step as the drafter's loop runs it) on batches like the data's."""
    vocab = target.embed_weight().shape[0]
    batches = sampled_batches(lengths, budget, vocab, iters + warmup)
    features = {}

    def run_target(batch):
        features[batch.index] = target(batch)

    t_wall, t_samples, t_peak = _timed(device, run_target, warmup, batches)
    d_wall, d_samples, d_peak = _timed(device, lambda batch: drafter_step(batch, features[batch.index]), warmup,
                                       batches)
    return RoleRates(t_samples / t_wall, d_samples / d_wall, f"measured on {device}", t_peak, d_peak)


def with_anchors(rates: RoleRates, target_shape, drafter_shape, lengths, anchors_from: int, anchors_to: int) -> RoleRates:
    """``rates`` at another number of anchors: the drafter's time scales with its FLOPs, the target's stays."""
    _, before = per_sample_flops(target_shape, drafter_shape, lengths, anchors_from)
    _, after = per_sample_flops(target_shape, drafter_shape, lengths, anchors_to)
    return replace(rates, drafter_samples_s=rates.drafter_samples_s * before / after)
