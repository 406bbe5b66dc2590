"""The memory model: what each role holds on one GPU, by component, and what the device then has in use.

One model for ``draftline plan`` (which layouts fit a GPU), ``train``'s preflight (the prediction beside what
it measures) and bench/memory_model.py (the model against an H200). Components (GiB), each in a category:

- weights: the target's bf16 layers (the ones its feature pass runs; all of them on the rank whose copy also
  decodes for evaluation), its embedding and LM head; the drafter's fp32 master weights (1/D sharded, then
  two layers' bf16 weights gathered);
- optimizer: AdamW's two moments (fp32, or bf16: ``optim.moments``), 1/D sharded;
- gradients: the drafter's fp32 gradients, held through the forward of a step's later passes;
- activations: the target's feature pass (its widest layer's row, ``TARGET_ROW_SHARE``); the drafter's pass
  (``drafter_memory``: what each layer keeps by recompute mode, the context rows, the LM head's chunk);
- features: feature batches [tokens, K*H] in bf16: the one the target builds, the target's outbox, the
  drafter's batch in hand and its queue (colocated: the hidden-state queue);
- outside the allocator (``outside``): CUDA's context and the libraries' own device memory, which torch's
  caching allocator does not count; and the allocator's fragmentation (``FRAGMENTATION``: reserved above
  allocated).

``MemoryEstimate.allocated`` is the predicted ``torch.cuda.max_memory_allocated``; ``MemoryEstimate.total`` what
must fit the GPU's capacity less preflight's headroom (allocated and outside the allocator); ``device`` the
device's memory in use at the peak of a run without a cap, as CUDA counts it (``cudaMemGetInfo``: total - free,
the figure torch's out-of-memory message and the GPU table's capacities use). The sizes are the worst case preflight measures: a
pass of ``max_query_rows`` block rows over the whole ``token_budget`` of context, after passes whose gradients
it holds, with the target's pass at the same moment on a colocated GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftline.config import default_q_hs
from draftline.sizing.drafter_memory import (
    ACTIVATIONS, FEATURES, GRADIENTS, MOMENT_BYTES, OPTIMIZER, WEIGHTS, PassSize, drafter_step, trained_params,
)
from draftline.sizing.shapes import LINEAR, DecoderShape, DrafterShape, TargetShape

__all__ = ["MemoryEstimate", "MemoryInputs", "colocated_memory", "drafter_memory", "method_memory", "split_memory",
           "target_memory", "trained_params"]

_GIB = 2**30

TARGET_ROW_SHARE = {"dense": 0.61, LINEAR: 0.74}
"""The target's feature pass holds this share of its widest layer's row (projection outputs and inputs, plus a
few residual-width tensors: ``_widest``) per token, besides the features it builds. Measured on one H200: the
Qwen3-8B shape's compiled pass at 32,768 tokens, 3.6 GiB above its weights and outbox with 1.25 GiB of features
(0.61, docs/benchmarks/2026-12-line-one-gpu.md's preflight); the Qwen3.6-27B hybrid's at 16,384 tokens, 2.92 GiB
with 0.78 of features (0.74, docs/benchmarks/2026-12-planner.md; its widest layer is a Gated DeltaNet one)."""

OUTSIDE_ALLOCATOR_GIB = 0.75
"""Device memory of one process outside torch's caching allocator once its kernels are loaded: CUDA's context,
the modules of the kernels it ran (cuBLAS, flex / FlashAttention, Triton's), library workspaces. Measured on
one H200 (torch 2.11, CUDA 13): 1.34 GiB of NVML's used memory above the allocator's reserved bytes after the
drafter's compiled step (docs/benchmarks/2026-12-drafter-memory.md), less the 0.59 GiB NVML also counts that
the driver keeps for itself (143,771 MiB in NVML, 139.81 GiB as torch reports the H200: outside the capacity
torch and the GPU table quote). ``train`` measures its own at start (``distributed.memory.DeviceBudget``)."""

NCCL_GIB = 0.5
"""NCCL's buffers and its communicators' state on each GPU of a job with several GPUs: assumed for planning
(not measured here); ``train`` measures what lies outside the allocator on each rank."""

FRAGMENTATION = 0.03
"""The caching allocator's reserved memory above its allocated peak, as a share of it: 3-5% measured for the
drafter step on an H200 without a cap (23.51 / 22.80, 19.85 / 18.88, 15.66 / 14.97 GiB reserved / allocated,
docs/benchmarks/2026-12-drafter-memory.md); about 1% at the 27B line under its cap, where the allocator frees
its cached blocks before it would exceed it (docs/benchmarks/2026-12-hybrid-27b.md)."""


@dataclass
class MemoryEstimate:
    """One GPU's memory at its peak, by component (GiB)."""

    parts: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Allocated by torch at the peak, by name: (category, GiB)."""
    outside: float = 0.0
    """GiB in use outside torch's caching allocator (context, libraries, NCCL)."""

    def of(self, category: str) -> float:
        return sum(gib for kind, gib in self.parts.values() if kind == category)

    @property
    def weights(self) -> float:
        return self.of(WEIGHTS)

    @property
    def optimizer(self) -> float:
        return self.of(OPTIMIZER)

    @property
    def gradients(self) -> float:
        return self.of(GRADIENTS)

    @property
    def activations(self) -> float:
        return self.of(ACTIVATIONS)

    @property
    def buffers(self) -> float:
        """The feature batches held (built, queued, in hand)."""
        return self.of(FEATURES)

    @property
    def allocated(self) -> float:
        """The predicted peak of ``torch.cuda.max_memory_allocated``."""
        return sum(gib for _, gib in self.parts.values())

    @property
    def total(self) -> float:
        """What must fit the GPU's capacity less the headroom (as preflight checks it): the allocator's peak and
        what lies outside the allocator. The headroom leaves the room that fragmentation takes under a cap,
        where the allocator frees its cached blocks before it would pass it."""
        return self.allocated + self.outside

    @property
    def reserved(self) -> float:
        """The allocator's reserved memory at the peak of a run without a cap (cached blocks kept)."""
        return self.allocated * (1 + FRAGMENTATION)

    @property
    def device(self) -> float:
        """The device's memory in use at the peak of a run without a cap (``cudaMemGetInfo``: total - free)."""
        return self.reserved + self.outside

    def describe(self) -> str:
        return (f"{self.total:.1f} GiB (allocated {self.allocated:.1f}: weights {self.weights:.1f}, optimizer "
                f"{self.optimizer:.1f}, gradients {self.gradients:.1f}, activations {self.activations:.1f}, features "
                f"{self.buffers:.1f}; outside the allocator {self.outside:.1f}; without a cap the device would show "
                f"{self.device:.1f})")

    def table(self) -> list[tuple[str, str, float]]:
        """Every component, then what lies outside the allocator and (without a cap) its fragmentation:
        (name, category, GiB)."""
        rows = [(name, kind, gib) for name, (kind, gib) in self.parts.items()]
        rows.append(("outside the allocator (CUDA context, libraries, NCCL)", "device", self.outside))
        rows.append(("without a cap: the allocator's cached blocks (reserved above allocated)", "device",
                     self.reserved - self.allocated))
        return rows

    def __add__(self, other: "MemoryEstimate") -> "MemoryEstimate":
        """Two roles in one process: their parts side by side, one process's memory outside the allocator."""
        parts = dict(self.parts)
        for name, value in other.parts.items():
            parts[name if name not in parts else f"{name} (2)"] = value
        return MemoryEstimate(parts, max(self.outside, other.outside))


def outside_allocator(num_gpus: int) -> float:
    """GiB a process holds outside the allocator: its context and kernels, and NCCL's with several GPUs."""
    return OUTSIDE_ALLOCATOR_GIB + (NCCL_GIB if num_gpus > 1 else 0.0)


def _widest(shape: DecoderShape) -> float:
    """Columns a token's row fans out to in the widest layer (projection outputs + inputs): about
    its per-token weights over the width, plus a few residual-width tensors."""
    return max(layer.token_params / shape.hidden_size for layer in shape.layers) + 4 * shape.hidden_size


def _row_share(shape: DecoderShape) -> float:
    widest = max(shape.layers, key=lambda layer: layer.token_params)
    return TARGET_ROW_SHARE[LINEAR if widest.kind == LINEAR else "dense"]


def target_pass_bytes(shape: DecoderShape, layers_run: int, tokens: int, num_feature_layers: int) -> tuple[float, float]:
    """(activations, features built) in bytes of the target's feature pass over ``tokens``, above its weights."""
    run = shape.with_layers_run(layers_run)
    return (_row_share(run) * tokens * _widest(run) * 2, 2.0 * tokens * num_feature_layers * shape.hidden_size)


def target_weight_bytes(shape: DecoderShape, bytes_per_value: int = 2, fp8: bool = False) -> float:
    """The target's weights in memory: its layers' and its embedding and LM head's. ``fp8`` (``--target-fp8``): the
    layers' linear weights at one byte (their scales, one fp32 per output channel, aside); a mixture of experts'
    routed experts, which are not ``nn.Linear`` modules, and the Gated DeltaNet's convolutions stay in
    ``bytes_per_value``."""
    if not fp8:
        return shape.params() * bytes_per_value
    kept = 2 * shape.hidden_size * shape.vocab_size + sum(
        layer.stored_mlp_params + layer.conv_channels * layer.conv_kernel for layer in shape.layers)
    return (shape.params() - kept) * 1 + kept * bytes_per_value


def target_memory(shape: DecoderShape, layers_run: int, token_budget: int, num_feature_layers: int,
                  queued_batches: int, bytes_per_value: int = 2, *, layers_kept: int | None = None,
                  num_gpus: int = 1, fp8: bool = False) -> MemoryEstimate:
    """The frozen target: ``layers_kept`` of its layers in bf16 (default the ``layers_run`` its feature pass runs;
    the evaluating copy keeps all; ``fp8``: their linear weights in FP8) with its embedding and head; its pass over
    ``token_budget`` tokens (activations and the features it builds); ``queued_batches`` feature batches waiting in
    its outbox."""
    kept = shape.with_layers_run(layers_kept or layers_run)
    activations, built = target_pass_bytes(shape, layers_run, token_budget, num_feature_layers)
    per_batch = token_budget * num_feature_layers * shape.hidden_size * bytes_per_value
    parts = {
        f"target weights ({'FP8 linear layers' if fp8 else 'bf16'}, {kept.num_layers} layers, embedding and LM head)": (
            WEIGHTS, target_weight_bytes(kept, bytes_per_value, fp8) / _GIB),
        "target pass: activations": (ACTIVATIONS, activations / _GIB),
        "target pass: the features it builds": (FEATURES, built / _GIB),
    }
    if queued_batches:
        parts[f"target outbox: {queued_batches} feature batch(es)"] = (FEATURES, queued_batches * per_batch / _GIB)
    return MemoryEstimate(parts, outside_allocator(num_gpus))


def several_passes(token_budget: int, max_query_rows: int, block_size: int) -> bool:
    """Whether a batch can take several drafter passes (then a later pass holds the earlier ones' gradients): a
    batch of ``token_budget`` tokens has up to about that many anchors, each ``block_size`` rows."""
    return token_budget * block_size > max_query_rows


def drafter_memory(shape: DrafterShape, token_budget: int, max_query_rows: int, queued_batches: int,
                   bytes_per_value: int = 2, num_shards: int = 1, frozen_weights: bool = True,
                   head_chunk_rows: int = 4096, *, recompute: str = "cheap", moments: str = "fp32",
                   activation_checkpointing: bool = False, num_gpus: int | None = None) -> MemoryEstimate:
    """The drafter's worst-case step on one GPU (``drafter_memory.drafter_step``): a pass of ``max_query_rows``
    block rows over ``token_budget`` context rows, holding the gradients of the step's earlier passes when a batch
    can take several; its state 1/``num_shards`` when sharded; the frozen embedding and head (``frozen_weights``:
    not when a colocated target holds them); the batch in hand and ``queued_batches`` more."""
    block = shape.block_size
    anchors = max(1, max_query_rows // block)
    step = drafter_step(shape, PassSize.of(anchors, block, token_budget), recompute=recompute,
                        head_chunk_rows=head_chunk_rows, moments=moments, num_shards=num_shards,
                        frozen_weights=frozen_weights, gradients_held=several_passes(token_budget, max_query_rows, block),
                        activation_checkpointing=activation_checkpointing, feature_batches=1 + queued_batches,
                        feature_rows=token_budget)
    parts = {name: (kind, value / _GIB) for name, (kind, value) in step.components().items()}
    return MemoryEstimate(parts, outside_allocator(num_shards if num_gpus is None else num_gpus))


def method_memory(shape: DrafterShape, token_budget: int, max_query_rows: int, queued_batches: int,
                  bytes_per_value: int = 2, num_shards: int = 1, head_chunk_rows: int = 4096,
                  moments: str = "fp32") -> MemoryEstimate:
    """What the drafter's training method adds to ``drafter_memory`` (``shape.method``; nothing for DFlash): its
    heads' fp32 master weights and gradients and AdamW's moments, 1/``num_shards`` each; the target's final hidden
    state, ``hidden_size`` more feature columns in the batch trained and the ``queued_batches`` held; its own loss's
    chunk (``loss_chunk_rows`` x vocabulary x ``loss_bytes_per_logit``, in place of the DFlash head loss's bf16
    chunk) and the buffers it keeps for a pass."""
    method = shape.method
    parts: dict[str, tuple[str, float]] = {}
    heads = method.head_params // num_shards
    if heads:
        parts["the method's heads: fp32 master weights"] = (WEIGHTS, 4 * heads / _GIB)
        parts[f"the method's heads: AdamW moments ({moments})"] = (OPTIMIZER, MOMENT_BYTES[moments] * heads / _GIB)
        parts["the method's heads: fp32 gradients"] = (GRADIENTS, 4 * heads / _GIB)
    if method.final_hidden:
        columns = shape.hidden_size * bytes_per_value * token_budget
        parts[f"the target's final hidden state: {1 + queued_batches} batch(es)"] = (
            FEATURES, (1 + queued_batches) * columns / _GIB)
    if method.loss_chunk_rows:
        own = min(method.loss_chunk_rows, max_query_rows) * shape.vocab_size * method.loss_bytes_per_logit
        replaced = min(head_chunk_rows, max_query_rows) * shape.vocab_size * 2  # drafter_step's "chunk of logits"
        parts["the method's loss chunk and buffers, less the head loss's chunk"] = (
            ACTIVATIONS, (own + method.loss_fixed_bytes - replaced) / _GIB)
    return MemoryEstimate(parts)


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory of a layout depends on besides its shape."""

    target_shape: TargetShape
    drafter_shape: DrafterShape
    layers_run: int
    num_feature_layers: int  # K (+1 with soft labels)
    q_hs: int | None
    """``topology.q_hs``; None: its default for each layout (``config.default_q_hs``)."""
    recompute: str = "cheap"
    moments: str = "fp32"
    head_chunk_rows: int = 4096
    activation_checkpointing: bool = False
    receive_batches: int = 3
    """Feature batches a drafter of a split holds besides the one it trains (its receive prefetch and the one
    arriving: ``RunSpec.queued_feature_batches``)."""
    target_fp8: bool = False
    """The target's linear layers in FP8 (``--target-fp8``)."""

    def drafter_options(self) -> dict:
        return dict(recompute=self.recompute, moments=self.moments, head_chunk_rows=self.head_chunk_rows,
                    activation_checkpointing=self.activation_checkpointing)


def split_memory(inputs: MemoryInputs, targets: int, drafters: int, budget: int, rows: int
                 ) -> tuple[MemoryEstimate, MemoryEstimate]:
    """(a target GPU's, a drafter GPU's) memory in a split: a target keeps the layers its pass runs; the first
    drafter's copy of the target for the evaluation during training, loaded at its first measurement, is not
    counted (a measurement that runs out of memory turns the measurements off: ``evaluate.during_training``)."""
    num_gpus = targets + drafters
    outbox = -(-default_q_hs(inputs.q_hs, colocated=False) // targets) + 1
    target = target_memory(inputs.target_shape, inputs.layers_run, budget, inputs.num_feature_layers, outbox,
                           num_gpus=num_gpus, fp8=inputs.target_fp8)
    drafter = drafter_memory(inputs.drafter_shape, budget, rows, inputs.receive_batches, num_shards=drafters,
                             num_gpus=num_gpus, **inputs.drafter_options())
    return target, drafter + method_memory(inputs.drafter_shape, budget, rows, inputs.receive_batches,
                                           num_shards=drafters, head_chunk_rows=inputs.head_chunk_rows,
                                           moments=inputs.moments)


def colocated_memory(inputs: MemoryInputs, num_gpus: int, budget: int, rows: int, *, num_shards: int | None = None,
                     keep_all_layers: bool = True, shared_head: bool = True) -> MemoryEstimate:
    """The busiest GPU of a colocated layout: its target (``keep_all_layers``: every layer, as the first rank's
    copy, which also decodes for the evaluation during training) with its pass, the hidden-state queue (q_hs
    batches), and its drafter's shard (``num_shards``, default one per GPU), all at their peaks at once. The
    target's embedding and head are shared with the drafter; ``shared_head`` False: the target's are split over a
    target group and the drafter holds whole copies."""
    target = target_memory(inputs.target_shape, inputs.layers_run, budget, inputs.num_feature_layers, 0,
                           layers_kept=inputs.target_shape.num_layers if keep_all_layers else None, num_gpus=num_gpus,
                           fp8=inputs.target_fp8)
    q_hs = default_q_hs(inputs.q_hs, colocated=True)
    drafter = drafter_memory(inputs.drafter_shape, budget, rows, q_hs,
                             num_shards=num_gpus if num_shards is None else num_shards,
                             frozen_weights=not shared_head, num_gpus=num_gpus, **inputs.drafter_options())
    shards = num_gpus if num_shards is None else num_shards
    return target + drafter + method_memory(inputs.drafter_shape, budget, rows, q_hs, num_shards=shards,
                                            head_chunk_rows=inputs.head_chunk_rows, moments=inputs.moments)
