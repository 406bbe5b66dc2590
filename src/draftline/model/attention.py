"""Who each block query may see: the DFlash visibility rule, as a dense mask and as a flex BlockMask.

Keys are laid out as ``[context rows (T) ; block rows (N * B)]``; query ``a * B + j`` is slot ``j``
of the block of anchor ``a``. The rule (docs/DFLASH.md):

- context row ``t`` is visible iff it is in the anchor's document and ``pos(t) < pos(anchor)``
  (strictly before the anchor: the anchor itself enters as slot 0 of the block);
- block row ``(a', i)`` is visible iff ``a' == a``: a block never sees another block;
- ``full_attention`` layers see their whole block (bidirectional); ``sliding_attention`` layers
  are causal inside the block (``i <= j``) and see only keys within ``sliding_window`` positions.

The dense path is exact and simple (CPU, tests, reference); the flex path builds a block-sparse
``BlockMask`` for ``torch.nn.attention.flex_attention`` on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class BlockLayout:
    """Where the anchors and context rows of one attention pass are."""

    context_doc: torch.Tensor  # [T] int: document id of each context row
    context_pos: torch.Tensor  # [T] int: position of each context row in its document
    anchor_doc: torch.Tensor  # [N] int
    anchor_pos: torch.Tensor  # [N] int: position of each anchor in its document
    block_size: int

    @property
    def num_context(self) -> int:
        return int(self.context_doc.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.anchor_doc.shape[0]) * self.block_size

    def block_positions(self) -> torch.Tensor:
        """Absolute positions of the block rows, [N * B]."""
        offsets = torch.arange(self.block_size, device=self.anchor_pos.device)
        return (self.anchor_pos[:, None] + offsets[None, :]).reshape(-1)

    def to(self, device: torch.device | str) -> "BlockLayout":
        return BlockLayout(
            self.context_doc.to(device, non_blocking=True),
            self.context_pos.to(device, non_blocking=True),
            self.anchor_doc.to(device, non_blocking=True),
            self.anchor_pos.to(device, non_blocking=True),
            self.block_size,
        )


def dense_mask(layout: BlockLayout, *, sliding: bool, window: int | None) -> torch.Tensor:
    """Boolean visibility [Q, T + Q] (True = may attend)."""
    block = layout.block_size
    anchors = layout.anchor_doc.shape[0]
    device = layout.anchor_doc.device
    slot = torch.arange(block, device=device)
    q_anchor = torch.arange(anchors, device=device).repeat_interleave(block)  # [Q]
    q_slot = slot.repeat(anchors)  # [Q]
    q_pos = layout.anchor_pos[q_anchor] + q_slot

    same_doc = layout.anchor_doc[q_anchor, None] == layout.context_doc[None, :]
    ctx_visible = same_doc & (layout.context_pos[None, :] < layout.anchor_pos[q_anchor, None])
    blk_visible = q_anchor[:, None] == q_anchor[None, :]
    if sliding:
        blk_visible = blk_visible & (q_slot[None, :] <= q_slot[:, None])
        if window is not None:
            ctx_visible = ctx_visible & (q_pos[:, None] - layout.context_pos[None, :] < window)
            blk_visible = blk_visible & (q_slot[:, None] - q_slot[None, :] < window)
    return torch.cat([ctx_visible, blk_visible], dim=1)


class DenseAttention:
    """Exact attention with a materialised mask: O(Q * (T + Q)) memory. The reference path."""

    def __init__(self, layout: BlockLayout, layer_types: list[str], sliding_window: int | None, scale: float):
        self.scale = scale
        self.layer_types = layer_types
        masks: dict[str, torch.Tensor] = {}
        for kind in set(layer_types):
            masks[kind] = dense_mask(layout, sliding=kind == "sliding_attention", window=sliding_window)
        self.masks = masks

    def __call__(self, q, k, v, layer_idx):
        mask = self.masks[self.layer_types[layer_idx]]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None, None], scale=self.scale, enable_gqa=q.shape[1] != k.shape[1]
        )


class FlexAttention:
    """Block-sparse attention through ``flex_attention``: only visible 128x128 tiles are computed."""

    def __init__(self, layout: BlockLayout, layer_types: list[str], sliding_window: int | None, scale: float):
        from torch.nn.attention.flex_attention import create_block_mask

        self.scale = scale
        self.layer_types = layer_types
        # Compiled kernels on GPU; on CPU the eager flex path is a slow but exact cross-check.
        self.compiled = layout.context_doc.is_cuda
        num_ctx = layout.num_context
        block = layout.block_size
        ctx_doc, ctx_pos = layout.context_doc, layout.context_pos
        anchor_doc, anchor_pos = layout.anchor_doc, layout.anchor_pos
        total_kv = num_ctx + layout.num_queries

        def make(sliding: bool):
            def mask_mod(b, h, q_idx, kv_idx):
                a = q_idx // block
                j = q_idx % block
                is_ctx = kv_idx < num_ctx
                t = torch.where(is_ctx, kv_idx, 0)
                kb = torch.where(is_ctx, 0, kv_idx - num_ctx)
                ctx_ok = is_ctx & (ctx_doc[t] == anchor_doc[a]) & (ctx_pos[t] < anchor_pos[a])
                blk_ok = (~is_ctx) & (kb // block == a)
                if sliding:
                    i = kb % block
                    blk_ok = blk_ok & (i <= j)
                    if sliding_window is not None:
                        ctx_ok = ctx_ok & (anchor_pos[a] + j - ctx_pos[t] < sliding_window)
                        blk_ok = blk_ok & (j - i < sliding_window)
                return ctx_ok | blk_ok

            return create_block_mask(
                mask_mod, None, None, layout.num_queries, total_kv, device=ctx_doc.device, _compile=self.compiled
            )

        self.block_masks = {kind: make(kind == "sliding_attention") for kind in set(layer_types)}

    def __call__(self, q, k, v, layer_idx):
        from torch.nn.attention.flex_attention import flex_attention

        mask = self.block_masks[self.layer_types[layer_idx]]
        kernel = _compiled_flex() if self.compiled else flex_attention
        return kernel(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def make_attention(layout: BlockLayout, config, backend: str = "auto"):
    """The attention for ``layout`` with ``config``'s layer types: 'dense', 'flex' or 'auto'."""
    layer_types = list(config.layer_types)
    window = config.sliding_window if "sliding_attention" in layer_types else None
    scale = config.head_dim**-0.5
    if backend == "auto":
        backend = "flex" if layout.context_doc.is_cuda else "dense"
    if backend == "dense":
        return DenseAttention(layout, layer_types, window, scale)
    if backend == "flex":
        return FlexAttention(layout, layer_types, window, scale)
    raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'dense' or 'flex'")
