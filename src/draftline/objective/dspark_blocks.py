"""DSpark's training blocks: the anchor is the first prediction slot.

Block of anchor p (x the document's tokens), the same inputs, positions and visibility as DFlash's
(``objective.blocks``): ``[x_p, MASK x (B-1)]`` at positions ``p .. p+B-1``. The labels differ:

| slot ``k`` | label | previous token (Markov input) | teacher row | weight |
|---|---|---|---|---|
| ``0 .. B-1`` | ``x_{p+k+1}`` | ``x_{p+k}`` (the anchor for slot 0) | ``p + k`` | ``exp(-k / gamma)`` |

So B inputs give B drafted tokens (DFlash: B - 1, slot 0 unlabelled). A block's supervision stops at its first
slot without a label (past the document's end or on a masked-out token): the slots after it are not labelled
either, since at decoding a draft after a rejected one is never accepted. The previous tokens are the data's
own (teacher forcing), so every slot's Markov bias is computed at once. The target's final hidden state at
the teacher row ``p + k`` predicts slot ``k``'s label: through the frozen LM head it gives the target's
distribution for the slot. Anchors are ``objective.anchors``'s: ``loss_mask[p]`` and ``loss_mask[p+1]`` set, so
every block has at least slot 0's label.

Built on the host from CPU tensors, as ``objective.blocks.build_blocks``; the result is a ``BlockBatch`` with
``prev_ids`` set.
"""

from __future__ import annotations

import math

import torch

from draftline.data.batch import PackedBatch
from draftline.model.attention import BlockLayout
from draftline.objective.blocks import BlockBatch

DEFAULT_GAMMA = 4.0
"""DeepSpec trains every DSpark drafter with ``loss_decay_gamma`` 4 (its configs: block 7); SpecForge's
Qwen3.6-27B DSpark recipe (block 16) uses 4 as well."""


def default_dspark_gamma(block_size: int) -> float:
    """Decay constant of DSpark's position weights exp(-k / gamma), k from 0."""
    del block_size  # both references use 4 whatever the block size
    return DEFAULT_GAMMA


def dspark_position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of each block slot, [B]: exp(-k / gamma) from k = 0 (every slot is labelled)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / gamma)


def build_dspark_blocks(
    batch: PackedBatch,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    """DSpark blocks for ``anchors`` (flat token indices into ``batch``, sorted), on the host."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if math.isnan(gamma) or gamma <= 0:
        raise ValueError(f"gamma must be a positive number (inf: every label weight 1), got {gamma}")
    input_ids = batch.input_ids.cpu()
    loss_mask = batch.loss_mask.cpu()
    doc_of_token = batch.doc_ids().cpu()
    pos_of_token = batch.positions().cpu()
    doc_end = (batch.doc_starts() + batch.doc_lengths).cpu()  # exclusive, per document
    num_tokens = input_ids.shape[0]
    num_anchors = int(anchors.shape[0])

    slots = torch.arange(block_size)
    anchor_doc = doc_of_token[anchors]
    anchor_pos = pos_of_token[anchors]
    block_ids = torch.full((num_anchors, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = input_ids[anchors]
    block_positions = anchor_pos[:, None] + slots[None, :]

    # Slot k's label is the token after its position, x_{p+k+1}; the block stops at its first unlabelled slot.
    label_index = anchors[:, None] + slots[None, :] + 1  # [N, B]
    inside = label_index < doc_end[anchor_doc][:, None]
    safe_index = label_index.clamp(max=num_tokens - 1)
    valid = (inside & loss_mask[safe_index]).to(torch.int32).cumprod(dim=1).bool()
    weights = dspark_position_weights(block_size, gamma)[None, :].expand(num_anchors, block_size)

    label_rows = torch.nonzero(valid.reshape(-1), as_tuple=False).flatten()
    label_tokens = safe_index.reshape(-1)[label_rows]
    teacher_rows = label_tokens - 1  # p + k: the target's output there predicts the label
    layout = BlockLayout(doc_of_token, pos_of_token, anchor_doc, anchor_pos, block_size)
    return BlockBatch(
        layout=layout,
        block_input_ids=block_ids.reshape(-1),
        block_positions=block_positions.reshape(-1),
        context_positions=pos_of_token,
        label_rows=label_rows,
        labels=input_ids[label_tokens],
        label_weights=weights.reshape(-1)[label_rows].contiguous(),
        teacher_rows=teacher_rows,
        num_anchors=num_anchors,
        block_size=block_size,
        prev_ids=input_ids[teacher_rows],
    )
