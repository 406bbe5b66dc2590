"""The DFlash drafter: architecture only.

A stack of Qwen3-style decoder layers whose queries come from a block of tokens
``[anchor, MASK x (B-1)]`` and whose keys/values are the fused target features (the context)
followed by the block itself. Which key each query may see is not decided here: the caller passes
an ``attend`` function (see ``draftline.model.attention``) that applies the block-sparse mask of a
training batch or of one inference step. Embedding and LM head belong to the target and are passed
in by the caller; nothing here is parallel, compiled or saved.

Tensors are flat, without a batch axis: ``[rows, hidden]``. Attention reshapes to
``[1, heads, rows, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from draftline.model.config import target_layer_ids


class Attend(Protocol):
    """Masked attention for one layer: q [1, h, Q, d], k/v [1, kv_h, K, d] -> [1, h, Q, d]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (Qwen3's order of operations).

    The output keeps the input's dtype: with fp32 master weights under bf16 autocast, an fp32
    ``weight * x`` would make every normed activation (and q/k for attention) fp32.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype)).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, rows, d]; cos/sin [rows, d]."""
    return x * cos + _rotate_half(x) * sin


class RotaryTable:
    """RoPE cos/sin for absolute positions, from the config's rope settings.

    Not a module: its fp32 frequencies stay fp32 whatever dtype the drafter is cast to.
    """

    def __init__(self, config: Qwen3Config):
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} depends on the sequence length; the drafter supports static RoPE types")
        with torch.device("cpu"):
            if rope_type == "default":
                inv_freq, scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
            else:
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.inv_freq = inv_freq.float()
        self.scale = float(scale)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


@dataclass
class ContextCache:
    """Per-layer keys/values of the context seen so far (inference only; blocks are never cached)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


class DrafterAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], num_heads, self.head_dim).transpose(0, 1).unsqueeze(0)

    def project(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
        cache: ContextCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1, h, Q, d] of the block rows; k, v [1, kv_h, T + Q, d] of context then block rows."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), *rope_block)
        # Same projections for context and block: the context is injected as extra keys/values.
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), *rope_context)
        v_ctx = self._heads(self.v_proj(context), self.num_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(self.layer_idx, k_ctx, v_ctx)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *rope_block)
        v_blk = self._heads(self.v_proj(x), self.num_kv_heads)
        return q, torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [1, h, Q, d] -> o_proj [Q, H]."""
        out = out.squeeze(0).transpose(0, 1).reshape(out.shape[2], self.num_heads * self.head_dim)
        return self.o_proj(out)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
        cache: ContextCache | None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, context, rope_block, rope_context, cache)
        return self.output(attend(q, k, v, self.layer_idx))


class DrafterMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # The layer in two halves around the attention kernel, so that compilation (applied from
    # outside, see ``draftline.model.fused``) can fuse each half and leave the masked attention alone.
    def attention_inputs(self, x, context, rope_block, rope_context, cache=None):
        """q, k, v of this layer. The context does not pass through input_layernorm; only the block does."""
        return self.self_attn.project(self.input_layernorm(x), context, rope_block, rope_context, cache)

    def attention_outputs_and_mlp(self, x, attn_out):
        """The residual stream after this layer, from its input ``x`` and the attention output."""
        x = x + self.self_attn.output(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, context, rope_block, rope_context, attend, cache):
        q, k, v = self.attention_inputs(x, context, rope_block, rope_context, cache)
        return self.attention_outputs_and_mlp(x, attend(q, k, v, self.self_attn.layer_idx))


class DFlashDrafter(nn.Module):
    """The DFlash draft model. Parameter names match the z-lab checkpoint format exactly."""

    method = "dflash"
    """The training method whose drafter this is (``draftline.methods``): what decodes it and how it is exported."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.block_size = int(config.block_size)
        self.target_layer_ids = target_layer_ids(config)
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = RotaryTable(config)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None) -> None:
        """Normal(0, initializer_range) linears, unit norms (the Qwen3 initialisation)."""
        std = std if std is not None else float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def heads(self) -> list[nn.Module]:
        """The modules a method adds beside the backbone, each called on its own after ``forward`` (DSpark's
        Markov and confidence heads); none for DFlash. Sharding makes each its own unit (``distributed.shard``)."""
        return []

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, like.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features [T, K*H] -> context C [T, H]."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        block_embeds: torch.Tensor,
        context_features: torch.Tensor,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        attend: Attend,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the block rows (after ``norm``), [Q, H].

        block_embeds [Q, H]: target embeddings of the block tokens.
        context_features [T, K*H]: the target features of the (new) context rows.
        block_positions [Q], context_positions [T]: absolute positions for RoPE.
        """
        context = self.project_context(context_features)
        rope_block = self.rope(block_positions, block_embeds)
        rope_context = self.rope(context_positions, block_embeds)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_context, attend, cache)
        return self.norm(x)


def checkpoint_layers(drafter: DFlashDrafter) -> None:
    """Recompute each decoder layer in backward instead of storing its activations."""
    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped
        layer.checkpointed = True  # compilation keeps nothing else of such a layer (model.fused)
