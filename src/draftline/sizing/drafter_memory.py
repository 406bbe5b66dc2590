"""The drafter step's memory, component by component: what a pass keeps for backward, the LM head's chunk of
logits, the state (fp32 master weights, AdamW's moments, gradients) and the features in hand.

The per-layer terms are what the drafter's compiled halves keep for backward in each recompute mode
(``model.recompute``), the attention kernel's inputs and outputs, and the layer's output; they equal what
Inductor's min-cut partitioner keeps on a traced tiny layer (``traced_layer_saved``, held equal by
tests/sizing/test_drafter_memory.py). Sized at the Qwen3-8B shape (one 3,072-token sample, 512 anchors, head
chunks of 2,048 rows) the peak is 23.05 GiB predicted against 22.80 measured on an H200 for the code before the
cuts (``none``, the head's gradient in its own buffer), 18.79 against 18.88 with ``cheap`` and 14.88 against
14.97 with bf16 moments (docs/benchmarks/2026-12-drafter-memory.md).

The peak of a step is the largest of three moments: the end of a pass's forward (in the head loss: every
layer's kept activations, one chunk of logits), the backward (layer by layer, the gradients growing while the
activations are freed) and the end of the backward (the fp32 gradients, all held for the global clip, then
AdamW). A step whose batches take several passes holds the gradients of the passes before during the next
forward (``gradients_held``): then the first moment is the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftline.model.recompute import MODES as RECOMPUTE_MODES
from draftline.sizing.shapes import DrafterShape, LayerShape

GIB = 2**30
MOMENT_BYTES = {"fp32": 8, "bf16": 4}
"""Bytes per trained weight of AdamW's two moments (``optim.moments``)."""

WEIGHTS, OPTIMIZER, GRADIENTS, ACTIVATIONS, FEATURES = "weights", "optimizer", "gradients", "activations", "features"
CATEGORIES = (WEIGHTS, OPTIMIZER, GRADIENTS, ACTIVATIONS, FEATURES)


@dataclass(frozen=True)
class PassSize:
    """One drafter pass: its block rows, the context rows its blocks attend to, and the rows with a label."""

    query_rows: int
    """Anchors x block size."""
    context_rows: int
    """Tokens of the documents the pass's anchors come from (at most the token budget)."""
    label_rows: int
    """Anchors x (block size - 1): the rows the LM head and its loss run on."""

    @classmethod
    def of(cls, anchors: int, block_size: int, context_rows: int) -> "PassSize":
        return cls(anchors * block_size, context_rows, anchors * (block_size - 1))


def intermediate_size(shape: DrafterShape, layer: LayerShape) -> int:
    return layer.mlp_params // (3 * shape.hidden_size)


def layer_params(shape: DrafterShape, layer: LayerShape) -> int:
    """A decoder layer's trained weights, its two RMSNorms and the q/k norms included."""
    return layer.token_params + 2 * shape.hidden_size + 2 * layer.head_dim


def trained_params(shape: DrafterShape) -> int:
    """The drafter's trained weights: its layers (norms included), ``fc`` and the final norm."""
    return (sum(layer_params(shape, layer) for layer in shape.layers)
            + len(shape.target_layer_ids) * shape.hidden_size ** 2 + 2 * shape.hidden_size)


def layer_saved(shape: DrafterShape, layer: LayerShape, size: PassSize, mode: str, *,
                weight_copies: bool = True) -> dict[str, int]:
    """Bytes one decoder layer keeps from its forward to its backward (bf16 activations, fp32 norm statistics).

    The compiled halves' part follows what the partitioner keeps (``traced_layer_saved``); the attention kernel
    keeps its inputs, output and log-sum-exp; the layer's output is the next layer's input. ``weight_copies``:
    autocast's bf16 copies of the fp32 weights (not under FSDP's bf16 gathers, which are freed after the
    forward and gathered again in the backward)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    Q, T, H, I = size.query_rows, size.context_rows, shape.hidden_size, intermediate_size(shape, layer)
    qw, kvw = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
    saved = {
        "attention kernel: q, k, v, out, lse": 2 * Q * qw + 2 * 2 * (T + Q) * kvw + 2 * Q * qw + 4 * layer.heads * Q,
        "layer output (the next layer's input)": 2 * Q * H,
        "q, k projections before their norms": 2 * Q * qw + 2 * (T + Q) * kvw,
        "norm statistics (fp32)": 4 * layer.kv_heads * Q,
    }
    if mode == "none":
        saved["norm statistics (fp32)"] = 4 * (2 * Q + layer.heads * Q + layer.kv_heads * (T + Q))
        saved["input norm output, post-attention norm output, residual"] = 3 * 2 * Q * H
        saved["o_proj input (attention output, transposed copy)"] = 2 * Q * qw
        saved["gate, up, silu(gate) * up"] = 3 * 2 * Q * I
        saved["bf16 copies of the layer's weights"] = (
            2 * (layer_params(shape, layer) - 2 * H - 2 * layer.head_dim) if weight_copies else 0)
    else:
        saved["o_proj output"] = 2 * Q * H
        if mode == "cheap":
            saved["gate, up"] = 2 * 2 * Q * I
    return saved


@dataclass
class DrafterStepMemory:
    """A step's memory (bytes): what it holds throughout, what each pass adds, and its three moments."""

    fixed: dict[str, tuple[str, int]]
    """Held through the step, by name: (category, bytes)."""
    per_layer: list[dict[str, int]]
    """What each decoder layer keeps for backward."""
    context: dict[str, int]
    head: dict[str, int]
    gradients: int
    """The fp32 gradients (this rank's share) at the end of a backward."""
    gradients_held: bool
    forward_end: int
    backward: int
    backward_end: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.forward_end, self.backward, self.backward_end)

    @property
    def layers_kept(self) -> int:
        return sum(sum(layer.values()) for layer in self.per_layer)

    def components(self) -> dict[str, tuple[str, int]]:
        """What is allocated at the peak, by name: (category, bytes); the values add up to ``peak``."""
        parts = dict(self.fixed)
        fixed = sum(b for _, b in self.fixed.values())
        if self.peak == self.forward_end:
            parts[f"activations kept by the {len(self.per_layer)} layers"] = (ACTIVATIONS, self.layers_kept)
            parts["context rows (fc output, normed context), block embeddings, final norm"] = (
                ACTIVATIONS, sum(self.context.values()))
            parts["LM head: labelled rows and their gradient"] = (ACTIVATIONS, self.head["labelled rows"])
            parts["LM head: one chunk of logits (its gradient in place)"] = (
                ACTIVATIONS, self.head["chunk of logits"] + self.head["the chunk's gradient in its own buffer"])
        elif self.peak == self.backward:
            parts["the backward's largest moment (activations left, gradients so far, the MLP's working set)"] = (
                ACTIVATIONS, self.backward - fixed)
        else:
            parts["fp32 gradients (the end of the backward, then AdamW)"] = (GRADIENTS, self.backward_end - fixed)
        return parts


def drafter_step(shape: DrafterShape, size: PassSize, *, recompute: str = "cheap", head_chunk_rows: int = 4096,
                 moments: str = "fp32", num_shards: int = 1, frozen_weights: bool = True, gradients_held: bool = False,
                 activation_checkpointing: bool = False, feature_batches: int = 1, head_copy: bool = False,
                 feature_rows: int | None = None) -> DrafterStepMemory:
    """The memory of one drafter rank's step with passes of ``size``.

    ``num_shards``: drafters the state is sharded over (FSDP2: 1/D of the fp32 weights, moments and gradients;
    two layers' bf16 weights gathered at a time and the root's (``fc``) held whole); ``frozen_weights``: the
    target's embedding and LM head in bf16 (not when a colocated target already holds them); ``gradients_held``:
    the gradients of an earlier pass of the step are there during this pass (a batch in several passes, or
    several batches a step); ``feature_batches``: feature batches [tokens, K*H] in bf16 on the rank (the one
    trained and those queued), each of ``feature_rows`` rows (default the pass's context rows); ``head_copy``:
    the code before the head's in-place gradient (a second chunk buffer)."""
    if moments not in MOMENT_BYTES:
        raise ValueError(f"AdamW moments must be one of {', '.join(MOMENT_BYTES)}, got {moments!r}")
    H, V, Q, T, M = shape.hidden_size, shape.vocab_size, size.query_rows, size.context_rows, size.label_rows
    P = trained_params(shape)
    sharded = num_shards > 1
    feature_width = len(shape.target_layer_ids) * H
    rows = T if feature_rows is None else feature_rows
    fixed = {
        "fp32 master weights": (WEIGHTS, 4 * P // num_shards),
        f"AdamW moments ({moments})": (OPTIMIZER, MOMENT_BYTES[moments] * P // num_shards),
    }
    if frozen_weights:
        fixed["the target's embedding and LM head (bf16, frozen)"] = (WEIGHTS, 2 * 2 * V * H)
    if sharded:
        largest = max(layer_params(shape, layer) for layer in shape.layers)
        fixed["bf16 weights gathered (two layers, and fc held whole)"] = (
            WEIGHTS, 2 * 2 * largest + 2 * len(shape.target_layer_ids) * H * H)
    fixed[f"features: {feature_batches} batch(es) of {rows:,} rows (bf16)"] = (
        FEATURES, feature_batches * 2 * rows * feature_width)
    gradients = 4 * P // num_shards
    if gradients_held:
        fixed["fp32 gradients of the step's earlier passes"] = (GRADIENTS, gradients)
    if activation_checkpointing:
        per_layer = [{"layer input (the layer recomputed in backward)": 2 * Q * H} for _ in shape.layers]
        recomputed = max(sum(layer_saved(shape, layer, size, "none", weight_copies=not sharded).values())
                         for layer in shape.layers)
    else:
        per_layer = [layer_saved(shape, layer, size, recompute, weight_copies=not sharded) for layer in shape.layers]
        recomputed = 0
    context = {"fc output, context C (normed), block embeddings": 2 * T * H * 2 + 2 * Q * H,
               "final norm: its output, held through the head loss": 2 * Q * H}
    chunk = min(head_chunk_rows, M)
    head = {"labelled rows": 2 * 2 * M * H, "chunk of logits": 2 * chunk * V,
            "the chunk's gradient in its own buffer": 2 * chunk * V if head_copy else 0}
    held = sum(b for _, b in fixed.values())
    forward_end = held + sum(sum(layer.values()) for layer in per_layer) + sum(context.values()) + sum(head.values())
    # Backward of layer i (the last first): the gradients of the layers after it exist (unless held already), its
    # own activations and those before it still do; the MLP's backward works on ~4 [Q, intermediate] bf16 tensors.
    working = max(4 * 2 * Q * intermediate_size(shape, layer) for layer in shape.layers) + recomputed
    if sharded:  # a layer's gradient whole (fp32) before its reduce-scatter
        working += 4 * max(layer_params(shape, layer) for layer in shape.layers)
    base = held + sum(context.values()) - 2 * Q * H
    kept = [sum(layer.values()) for layer in per_layer]
    grads_of = [0 if gradients_held else 4 * layer_params(shape, layer) // num_shards for layer in shape.layers]
    backward = max(base + sum(grads_of[i:]) + sum(kept[:i]) + working for i in range(len(kept), 0, -1))
    backward_end = held + (0 if gradients_held else gradients)
    return DrafterStepMemory(fixed, per_layer, context, head, gradients, gradients_held, forward_end, backward,
                             backward_end)


# ------------------------------------------------------------------------------------------ the check
def traced_layer_saved(mode: str) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """What the compiled halves of one tiny decoder layer keep for backward, as the partitioner torch.compile uses
    (min-cut) leaves it on this machine (no code generation): (half, shape, dtype, whether it is an input of the
    half: the layer input, the context, RoPE tables, the attention output). The tiny layer's sizes are
    ``TRACE_SIZES``: each dimension distinct, so a traced shape names its dimensions."""
    import torch
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from draftline.model.attention import make_attention
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.recompute import selective
    from draftline.objective.blocks import build_blocks
    from draftline.sizing.workload import packed_batch

    cfg = trace_config()
    saved, current = [], [""]

    def backward_compiler(gm, _inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and not node.name.startswith("tangents") and isinstance(value, torch.Tensor):
                saved.append((current[0], tuple(int(d) for d in value.shape), str(value.dtype)[6:],
                              node.name.startswith("primals")))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).float()
    layer = drafter.layers[0]
    for name in ("attention_inputs", "attention_outputs_and_mlp"):
        def labelled(gm, inputs, _name=name):  # the backward graph is made when the backward first runs
            current[0] = _name
            return backward_compiler(gm, inputs)

        backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=labelled,
                               partition_fn=min_cut_rematerialization_partition)
        fn = selective(getattr(layer, name), mode, intermediate_size=cfg.intermediate_size)
        setattr(layer, name, torch.compile(fn, backend=backend, fullgraph=True))
    batch = packed_batch([TRACE_SIZES["T"]], cfg.vocab_size, 0)
    anchors = torch.tensor([5, 40, 77, 120, 150])  # TRACE_SIZES["Q"] = 5 anchors x block 16
    blocks = build_blocks(batch, anchors, block_size=16, mask_token_id=0, gamma=7.0)
    feats = torch.randn(batch.num_tokens, len(drafter.target_layer_ids) * cfg.hidden_size).bfloat16()
    embeds = torch.randn(blocks.block_input_ids.shape[0], cfg.hidden_size).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(embeds, feats, blocks.block_positions, blocks.context_positions,
                      make_attention(blocks.layout, cfg, "dense"))
    out.float().sum().backward()
    torch._dynamo.reset()
    params = {(tuple(p.shape), str(p.dtype)[6:]) for p in layer.parameters()}
    return [entry for entry in saved if (entry[1], entry[2]) not in params]  # the fp32 weights live on anyway


TRACE_SIZES = {"Q": 80, "T": 160}
"""The traced pass: 5 anchors x block 16 query rows over a 160-token document."""


def trace_config():
    """The traced tiny drafter's config (one layer, block 16): hidden 128, intermediate 256, 4 heads x 32, 2 KV."""
    from transformers import Qwen3Config

    from draftline.model.config import build_drafter_config

    target = Qwen3Config(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=256, vocab_size=1000, max_position_embeddings=40960,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return build_drafter_config(target, num_hidden_layers=1, block_size=16)


def traced_bytes(mode: str, shape: DrafterShape, size: PassSize) -> tuple[int, list[tuple[str, str, int, bool]]]:
    """``traced_layer_saved(mode)`` sized at ``shape`` and ``size``: (bytes kept, inputs left out; each entry
    (half, dimensions named, bytes, whether it is an input))."""
    import torch

    cfg = trace_config()
    layer = shape.layers[0]
    names = {cfg.hidden_size: ("H", shape.hidden_size), cfg.intermediate_size: ("I", intermediate_size(shape, layer)),
             cfg.num_attention_heads: ("heads", layer.heads), cfg.num_key_value_heads: ("kv_heads", layer.kv_heads),
             cfg.head_dim: ("head_dim", layer.head_dim), TRACE_SIZES["Q"]: ("Q", size.query_rows),
             TRACE_SIZES["T"]: ("T", size.context_rows),
             cfg.num_key_value_heads * cfg.head_dim: ("kv_width", layer.kv_heads * layer.head_dim), 1: ("1", 1)}
    assert len(names) == 9, "the tiny shape's dimensions must differ from each other to be named"
    total, entries = 0, []
    for half, dims, dtype, is_input in traced_layer_saved(mode):
        size_bytes = math.prod(names[d][1] for d in dims) * getattr(torch, dtype).itemsize
        total += 0 if is_input else size_bytes
        entries.append((half, f"[{', '.join(names[d][0] for d in dims)}] {dtype}", size_bytes, is_input))
    return total, entries


def compiled_part(saved: dict[str, int]) -> int:
    """The compiled halves' share of ``layer_saved``: all but the attention kernel's and the layer output."""
    return sum(v for k, v in saved.items() if not k.startswith(("attention kernel", "layer output")))
