"""The sizes a model's FLOPs depend on, layer by layer, read from a Hugging Face config.

One description serves the target and the drafter: a ``DecoderShape`` is the residual width, the
vocabulary and one ``LayerShape`` per decoder layer. A layer is full attention, sliding-window
attention or linear attention (Gated DeltaNet), and its MLP is dense SwiGLU or a mixture of
experts (only the experts a token runs count, plus a shared expert and the router).
``DrafterShape`` adds what a DFlash drafter has on top: the target layers it reads and its block, and
(``MethodShape``) what its training method adds: DSpark's heads, the target's final hidden state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from draftline.model.config import text_config

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer."""

    kind: str
    """``FULL``, ``SLIDING`` or ``LINEAR`` (Gated DeltaNet)."""
    mixer_params: int
    """Weights of the token mixer one token's row passes through: q, k, v, o (with an output gate's
    extra q columns), or the linear-attention projections (qkv, z, a, b, out)."""
    mlp_params: int
    """MLP weights one token's row passes through: a dense SwiGLU, or the routed experts a token
    runs plus the shared expert and the router (and the shared expert's gate)."""
    heads: int
    """Attention: query heads. Linear attention: value heads (one recurrent state each)."""
    kv_heads: int
    """Attention: key/value heads (GQA). Linear attention: key heads."""
    head_dim: int
    """Attention: width of a head. Linear attention: key width of a state (its rows)."""
    value_dim: int = 0
    """Linear attention: value width of a state (its columns)."""
    conv_channels: int = 0
    """Linear attention: channels of the depthwise causal conv (q, k and v)."""
    conv_kernel: int = 0
    """Linear attention: taps of the causal conv."""
    window: int | None = None
    """Sliding attention: keys a query sees at most."""
    stored_mlp_params: int = 0
    """MLP weights in memory when more than a token runs (MoE: every expert); 0 = ``mlp_params``."""

    @property
    def token_params(self) -> int:
        return self.mixer_params + self.mlp_params

    @property
    def kv_width(self) -> int:
        """Output width of k plus v (attention layers)."""
        return 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class DecoderShape:
    """A decoder-only model: width, vocabulary, and its layers in order."""

    hidden_size: int
    vocab_size: int
    layers: tuple[LayerShape, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def of(cls, config: Any) -> "DecoderShape":
        """From a Hugging Face config (a multimodal one: its text part)."""
        text = text_config(config)
        types = _layer_types(text)
        return cls(int(text.hidden_size), int(text.vocab_size),
                   tuple(_layer(text, index, kind) for index, kind in enumerate(types)))

    @classmethod
    def uniform(cls, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                num_layers: int, vocab_size: int, **extra: Any) -> "DecoderShape":
        """Every layer full attention with a dense SwiGLU MLP (hand-sized shapes in tests and notes)."""
        layer = LayerShape(FULL, _attention_params(hidden_size, num_heads, num_kv_heads, head_dim, False),
                           3 * hidden_size * intermediate_size, num_heads, num_kv_heads, head_dim)
        return cls(hidden_size=hidden_size, vocab_size=vocab_size, layers=(layer,) * num_layers, **extra)

    def with_layers_run(self, num_layers_run: int) -> "DecoderShape":
        """The same model with only its first ``num_layers_run`` layers (what a feature pass runs)."""
        if not 1 <= num_layers_run <= self.num_layers:
            raise ValueError(f"num_layers_run={num_layers_run} must lie in [1, {self.num_layers}] (the model's layers)")
        return dataclasses.replace(self, layers=self.layers[:num_layers_run])

    def params(self) -> int:
        """All weights, MoE experts included (what sits in memory): layers, embedding and LM head."""
        return sum(_stored_params(layer) for layer in self.layers) + 2 * self.hidden_size * self.vocab_size


# The target is a plain decoder; the name says which role a shape plays.
TargetShape = DecoderShape


@dataclass(frozen=True)
class MethodShape:
    """What a training method adds to the DFlash drafter's FLOPs and memory (``draftline.methods``: each method
    describes its own as numbers; DFlash adds nothing). Per labelled row of a pass, and in memory."""

    drafts_anchor_slot: bool = False
    """The anchor's slot drafts too (DSpark): a block has up to B labelled rows, not B - 1."""
    head_params: int = 0
    """Trained weights beside the layers and ``fc`` (DSpark: the Markov head's embedding and projection, the
    gated head's gate, the confidence head): fp32 master weights, gradients and AdamW moments."""
    row_params: int = 0
    """Trained weights a labelled row passes through in matmuls (DSpark: the Markov projection r -> V, the gate,
    the confidence head; the embedding lookup is no matmul): forward and backward, input gradients included."""
    teacher_head: bool = False
    """Per labelled row the frozen LM head also runs, forward only, on the target's final hidden state (DSpark:
    the target's distribution)."""
    final_hidden: bool = False
    """The target runs every layer and sends its final hidden state: ``hidden_size`` more feature columns per token."""
    loss_chunk_rows: int = 0
    """Rows of the method's own full-vocabulary loss at once (0: the DFlash head loss's chunk)."""
    loss_bytes_per_logit: float = 0.0
    """Bytes per row and vocabulary entry of that chunk."""
    loss_fixed_bytes: int = 0
    """Buffers the loss holds for the whole pass (DSpark: the Markov projection's fp32 gradient, V x r)."""


@dataclass(frozen=True)
class DrafterShape(DecoderShape):
    """A DFlash drafter: its own layers, and the target layers that feed its ``fc``; ``method`` what the training
    method adds (DSpark's heads)."""

    target_layer_ids: tuple[int, ...] = ()
    """Target layers feeding ``fc`` (K = their number; ``fc`` is K*H -> H)."""
    block_size: int = 16
    """B: rows per anchor block (anchor + B-1 masks)."""
    teacher_layers: int = 0
    """Target layers run for soft labels (``--distill``: all of them); 0 = features only."""
    method: MethodShape = MethodShape()
    """What the method adds (``draftline.methods``: ``method.shape(config)``)."""

    @classmethod
    def of(cls, config: Any) -> "DrafterShape":
        """From the drafter's Qwen3Config (``dflash_config.target_layer_ids``, ``block_size``)."""
        base = DecoderShape.of(config)
        return cls(base.hidden_size, base.vocab_size, base.layers,
                   target_layer_ids=tuple(int(i) for i in config.dflash_config["target_layer_ids"]),
                   block_size=int(getattr(config, "block_size", 16)))

    @property
    def drafted_slots(self) -> int:
        """Labelled rows of a block at most: B - 1 (slot 0 holds the anchor), or B where the anchor's slot drafts."""
        return self.block_size - (0 if self.method.drafts_anchor_slot else 1)

    @property
    def target_layers_run(self) -> int:
        """How many target layers must run to produce this drafter's features (and soft labels)."""
        return max(max(self.target_layer_ids) + 1, self.teacher_layers)


# ---------------------------------------------------------------------------------------------
# Reading a config
# ---------------------------------------------------------------------------------------------


def _layer_types(text: Any) -> list[str]:
    num_layers = int(text.num_hidden_layers)
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) != num_layers:
        return [FULL] * num_layers
    return [kind if kind in (SLIDING, LINEAR) else FULL for kind in types]


def _attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, output_gate: bool) -> int:
    q_width = heads * head_dim * (2 if output_gate else 1)  # a gated q_proj also yields the output gate
    return hidden * q_width + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def _has_output_gate(text: Any) -> bool:
    default = (getattr(text, "model_type", "") or "").startswith(("qwen3_5", "qwen3_next"))
    return bool(getattr(text, "attn_output_gate", default))


def _is_sparse(text: Any, index: int) -> bool:
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not experts or not getattr(text, "num_experts_per_tok", None):
        return False
    if index in (getattr(text, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    return (index + 1) % step == 0


def _mlp_params(text: Any, index: int) -> tuple[int, int]:
    """(weights a token runs, weights in memory) of layer ``index``'s MLP."""
    hidden = int(text.hidden_size)
    if not _is_sparse(text, index):
        dense = 3 * hidden * int(text.intermediate_size)
        return dense, dense
    experts = int(getattr(text, "num_experts", None) or text.num_local_experts)
    expert = 3 * hidden * int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    router = hidden * experts
    shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    shared = 3 * hidden * shared + hidden if shared else 0  # the shared expert and its sigmoid gate
    return int(text.num_experts_per_tok) * expert + router + shared, experts * expert + router + shared


def _layer(text: Any, index: int, kind: str) -> LayerShape:
    hidden = int(text.hidden_size)
    mlp, stored = _mlp_params(text, index)
    mlp_fields = dict(stored_mlp_params=stored if stored != mlp else 0)
    if kind == LINEAR:
        key_heads, value_heads = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
        key_dim, value_dim = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
        keys, values = key_heads * key_dim, value_heads * value_dim
        # in_proj_qkv (q, k, v), in_proj_z (output gate), in_proj_a and in_proj_b (decay, beta), out_proj
        mixer = hidden * (2 * keys + values) + hidden * values + 2 * hidden * value_heads + values * hidden
        return LayerShape(LINEAR, mixer, mlp, value_heads, key_heads, key_dim, value_dim,
                          conv_channels=2 * keys + values, conv_kernel=int(getattr(text, "linear_conv_kernel_dim", 4)),
                          **mlp_fields)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    window = getattr(text, "sliding_window", None) if kind == SLIDING else None
    return LayerShape(kind, _attention_params(hidden, heads, kv_heads, head_dim, _has_output_gate(text)), mlp,
                      heads, kv_heads, head_dim, window=int(window) if window else None, **mlp_fields)


def _stored_params(layer: LayerShape) -> int:
    """Weights of a layer in memory (norms and per-head scalars aside)."""
    return layer.mixer_params + (layer.stored_mlp_params or layer.mlp_params) + layer.conv_channels * layer.conv_kernel
