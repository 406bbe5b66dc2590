"""The memory model of the node planner: what each role holds on one GPU, estimated from its shape.

Weights, optimizer state (sharded over the drafters), activations and queued features of a target, a
drafter and a colocated GPU (``target_memory``, ``drafter_memory``, ``colocated_memory``); the activation
coefficients are calibrated on one H200. ``draftline plan`` fits layouts with it; ``train``'s preflight then
measures the real worst case (``preflight``).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftline.sizing.shapes import DecoderShape, DrafterShape, TargetShape

_GIB = 2**30


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

    def __add__(self, other: "MemoryEstimate") -> "MemoryEstimate":
        return MemoryEstimate(self.weights + other.weights, self.optimizer + other.optimizer,
                              self.activations + other.activations, self.buffers + other.buffers)


# The activation coefficients, calibrated on one H200 (docs/benchmarks/2026-12-planner.md):
# the target's feature pass holds ~0.7 of its widest layer's row at a time (measured 0.61x on the Qwen3-8B
# shape, 0.79x on the Qwen3.6-27B shape); the drafter keeps ~2.1 values per trained weight column of each
# layer for each block row (the 8B step's preflight fit: 0.99 MB per row) and ~6 bytes per logit of one
# LM-head chunk (bf16 logits and their fp32 gradient; the 27B step at 4,096 rows: 9.3 GiB measured).
TARGET_ROW_SHARE = 0.7
DRAFTER_ROW_VALUES = 2.1
HEAD_CHUNK_BYTES_PER_LOGIT = 6


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
    activations = TARGET_ROW_SHARE * token_budget * _widest(run) * bytes_per_value
    features = (queued_batches + 1) * token_budget * num_feature_layers * shape.hidden_size * bytes_per_value
    return MemoryEstimate(weights / _GIB, 0.0, activations / _GIB, features / _GIB)


def trained_params(shape: DrafterShape) -> int:
    """The drafter's trained weights: its layers and ``fc`` (the norms are negligible)."""
    return sum(layer.token_params for layer in shape.layers) + len(shape.target_layer_ids) * shape.hidden_size ** 2


def drafter_memory(shape: DrafterShape, token_budget: int, max_query_rows: int, queued_batches: int,
                   bytes_per_value: int = 2, num_shards: int = 1, frozen_weights: bool = True,
                   head_chunk_rows: int = 4096) -> MemoryEstimate:
    """The drafter: fp32 master weights and gradients and AdamW's two fp32 moments (16 bytes per trained
    weight), each 1/``num_shards`` when sharded (then also two layers' bf16 weights gathered at a time);
    the frozen embedding and head in bf16 (``frozen_weights``: not when a colocated target holds them);
    activations kept for backward over ``max_query_rows`` block rows (``DRAFTER_ROW_VALUES`` per trained
    weight column of each layer), over the ``token_budget`` context rows (features, ``fc`` output, each layer's
    k and v), and one LM-head chunk's logits (``head_chunk_rows`` x vocabulary); received feature batches."""
    hidden = shape.hidden_size
    features_width = len(shape.target_layer_ids) * hidden
    trained = trained_params(shape)
    frozen = 2 * shape.vocab_size * hidden * bytes_per_value if frozen_weights else 0
    gathered = 0
    if num_shards > 1:
        gathered = 2 * max(layer.token_params for layer in shape.layers) * bytes_per_value
    per_row = DRAFTER_ROW_VALUES * sum(layer.token_params / hidden for layer in shape.layers) * bytes_per_value
    per_context = (features_width + hidden + sum(layer.kv_width for layer in shape.layers)) * bytes_per_value
    head_chunk = min(head_chunk_rows, max_query_rows) * shape.vocab_size * HEAD_CHUNK_BYTES_PER_LOGIT
    activations = max_query_rows * per_row + token_budget * per_context + head_chunk
    features = queued_batches * token_budget * features_width * bytes_per_value
    return MemoryEstimate((8 * trained / num_shards + frozen + gathered) / _GIB, 8 * trained / num_shards / _GIB,
                          activations / _GIB, features / _GIB)


def method_memory(shape: DrafterShape, token_budget: int, max_query_rows: int, queued_batches: int,
                  bytes_per_value: int = 2, num_shards: int = 1, head_chunk_rows: int = 4096) -> MemoryEstimate:
    """What the drafter's training method adds to ``drafter_memory`` (``shape.method``; nothing for DFlash): its
    heads' fp32 master weights, gradients and AdamW moments (16 bytes per weight, 1/``num_shards`` each); the
    target's final hidden state, ``hidden_size`` more feature columns in the batches received and the one trained;
    its own loss's chunk (``loss_chunk_rows`` x vocabulary x ``loss_bytes_per_logit``, in place of the DFlash
    head loss's chunk) and the buffers it keeps for a pass."""
    method = shape.method
    heads = method.head_params / num_shards
    extra_features = shape.hidden_size * bytes_per_value * token_budget if method.final_hidden else 0
    loss = 0.0
    if method.loss_chunk_rows:
        own = min(method.loss_chunk_rows, max_query_rows) * shape.vocab_size * method.loss_bytes_per_logit
        replaced = min(head_chunk_rows, max_query_rows) * shape.vocab_size * HEAD_CHUNK_BYTES_PER_LOGIT
        loss = own + method.loss_fixed_bytes - replaced
    return MemoryEstimate(8 * heads / _GIB, 8 * heads / _GIB, (extra_features + loss) / _GIB,
                          queued_batches * extra_features / _GIB)


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory of a layout depends on besides its shape."""

    target_shape: TargetShape
    drafter_shape: DrafterShape
    layers_run: int
    num_feature_layers: int  # K (+1 with soft labels)
    q_hs: int


def split_memory(inputs: MemoryInputs, targets: int, drafters: int, budget: int, rows: int
                 ) -> tuple[MemoryEstimate, MemoryEstimate]:
    """(a target GPU's, a drafter GPU's) memory in a split."""
    outbox = -(-inputs.q_hs // targets) + 1
    target = target_memory(inputs.target_shape, inputs.layers_run, budget, inputs.num_feature_layers, outbox)
    drafter = drafter_memory(inputs.drafter_shape, budget, rows, 3, num_shards=drafters)
    return target, drafter + method_memory(inputs.drafter_shape, budget, rows, 3, num_shards=drafters)


def colocated_memory(inputs: MemoryInputs, num_gpus: int, budget: int, rows: int,
                     shared_head: bool = True) -> MemoryEstimate:
    """A GPU's memory with its target (q_hs batches queued) and its drafter's shard (the target's embedding
    and head shared; ``shared_head`` False: the target's are split over a target group, the drafter holds whole
    copies)."""
    target = target_memory(inputs.target_shape, inputs.layers_run, budget, inputs.num_feature_layers, inputs.q_hs)
    return (target + drafter_memory(inputs.drafter_shape, budget, rows, 0, num_shards=num_gpus,
                                    frozen_weights=not shared_head)
            + method_memory(inputs.drafter_shape, budget, rows, 0, num_shards=num_gpus))
