"""Hybrid targets (Qwen3.5/3.6): packed documents through Gated DeltaNet layers, kept apart.

A Qwen3.5 text stack repeats three Gated DeltaNet (linear attention) layers and one gated
full-attention layer. A Gated DeltaNet layer carries a recurrent state along the sequence and a
causal convolution of a few taps before it, so on a packed row both would run from one document
into the next unless each is told where the documents start. transformers' layer only does that
with optional kernel packages and, depending on its version, with different argument names; so in
a packed feature pass ``packed_forward`` replaces the layer's forward: the same weights and the
same arithmetic, with flash-linear-attention's kernels given the documents' ``cu_seqlens``
(its Triton causal conv and its chunked gated delta rule), no state and no conv tap crossing a
boundary. Outside a feature pass (decoding for evaluation) the layer runs its own forward.

The full-attention layers keep packing through a per-document mask (flex ``BlockMask`` on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from draftline.errors import DraftlineError

INSTALL_HINT = "pip install 'draftline[hybrid]' (flash-linear-attention)"

# The attention implementation name the full-attention layers of a hybrid target run under on GPU:
# transformers' own flex-attention function, registered under a name of ours because the hybrid
# model classes refuse "flex_attention" by name at load time.
PACKED_FLEX = "draftline_flex"


def layer_types(text_config: Any) -> list[str]:
    """Per decoder layer: "full_attention", "sliding_attention" or "linear_attention"."""
    num_layers = int(text_config.num_hidden_layers)
    types = list(getattr(text_config, "layer_types", None) or [])
    return types if len(types) == num_layers else ["full_attention"] * num_layers


def is_hybrid(text_config: Any) -> bool:
    """True when some decoder layer is linear attention (Gated DeltaNet)."""
    return "linear_attention" in layer_types(text_config)


@dataclass(frozen=True)
class Kernels:
    """The two packed-sequence kernels a Gated DeltaNet layer needs, with fla's signatures.

    ``conv(x [1, T, D], weight [D, W], bias, activation, cu_seqlens) -> [1, T, D]``;
    ``delta_rule(q [1, T, Hk, dk], k, v [1, T, Hv, dv], g [1, T, Hv], beta, cu_seqlens) -> [1, T, Hv, dv]``
    with q and k L2-normalised inside, each key head serving ``Hv / Hk`` consecutive value heads.
    """

    conv: Callable[..., torch.Tensor]
    delta_rule: Callable[..., torch.Tensor]


def fla_kernels() -> Kernels:
    """flash-linear-attention's kernels; a DraftlineError naming the install command without it."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise DraftlineError(
            f"a hybrid target (Gated DeltaNet layers, e.g. Qwen3.5/3.6) needs flash-linear-attention on GPU to "
            f"keep packed documents apart ({exc}); install it: {INSTALL_HINT}"
        ) from None

    def conv(x, weight, bias, activation, cu_seqlens):
        return causal_conv1d(x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens)[0]

    def delta_rule(q, k, v, g, beta, cu_seqlens):
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=cu_seqlens)
        return out

    return Kernels(conv, delta_rule)


def check_layer(module: torch.nn.Module) -> None:
    """Refuse a linear-attention layer whose weights are not the Qwen3.5 Gated DeltaNet's."""
    needed = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        raise DraftlineError(
            f"{type(module).__name__}: a linear-attention layer without {missing}; draftline packs the Qwen3.5/3.6 "
            "Gated DeltaNet (qwen3_5, qwen3_5_moe). Run this target with --device cpu (one document per row)."
        )


def project_inputs(module: torch.nn.Module, hidden_states: torch.Tensor):
    """The projections a Gated DeltaNet layer makes of its input before its kernels, and its gates:
    (q/k/v before the convolution [1, T, 2 Dk + Dv], beta [1, T, Hv], g [1, T, Hv] in fp32)."""
    mixed = module.in_proj_qkv(hidden_states)
    beta = module.in_proj_b(hidden_states).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    return mixed, beta, g


def gated_output(module: torch.nn.Module, core: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The delta rule's output ``core`` [1, T, Hv, dv] normed and gated by ``z`` (a projection of the layer's input),
    then ``out_proj``: [1, T, H]."""
    head_v = module.head_v_dim
    z = module.in_proj_z(hidden_states)
    out = module.norm(core.reshape(-1, head_v), z.reshape(-1, head_v)).reshape(*hidden_states.shape[:2], -1)
    return module.out_proj(out)


@dataclass(frozen=True)
class Stages:
    """The two stages of a packed Gated DeltaNet layer around fla's kernels: ``project_inputs`` and ``gated_output``,
    or compiled copies of them (``model.fused.compile_target``: their elementwise work fuses with the projections)."""

    inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = project_inputs
    output: Callable[..., torch.Tensor] = gated_output


def packed_forward(module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                   kernels: Kernels, stages: Stages = Stages()) -> torch.Tensor:
    """transformers' ``Qwen3_5GatedDeltaNet.forward`` (no cache) on a packed row [1, T, H]."""
    batch, length, _ = hidden_states.shape
    if batch != 1:
        raise ValueError(f"a packed Gated DeltaNet pass takes one row, got {batch}")
    head_k, head_v = module.head_k_dim, module.head_v_dim
    mixed, beta, g = stages.inputs(module, hidden_states)
    mixed = kernels.conv(mixed, module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation, cu_seqlens)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, length, -1, head_k)
    key = key.reshape(1, length, -1, head_k)
    value = value.reshape(1, length, -1, head_v)
    return stages.output(module, kernels.delta_rule(query, key, value, g, beta, cu_seqlens), hidden_states)


def register_packed_flex() -> str:
    """Register ``PACKED_FLEX`` with transformers (its flex-attention function and mask builder)."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    AttentionInterface.register(PACKED_FLEX, flex_attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flex_attention_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_FLEX, flex_attention_mask)
    except ImportError:  # an older layout: masks are only ever given ready-made in a feature pass
        pass
    return PACKED_FLEX
