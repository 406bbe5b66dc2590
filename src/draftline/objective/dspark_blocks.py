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

import torch

from draftline.data.batch import PackedBatch
from draftline.objective.blocks import BlockBatch, TeacherRows, check_gamma, labelled_blocks

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
    chunk_rows: int | None = None,
) -> BlockBatch:
    """DSpark blocks for ``anchors`` (flat token indices into ``batch``, sorted), on the host; with
    ``chunk_rows`` (the loss's chunks), each chunk's distinct teacher rows (``distinct_teacher_rows``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    check_gamma(gamma)
    # Slot k's label is the token after its position, x_{p+k+1}; the block stops at its first unlabelled slot.
    blocks = labelled_blocks(batch, anchors, block_size=block_size, mask_token_id=mask_token_id,
                             weights=dspark_position_weights(block_size, gamma), label_offset=1,
                             stop_at_first_gap=True, with_prev_ids=True)
    if chunk_rows is not None:
        blocks.teacher = distinct_teacher_rows(blocks.teacher_rows, chunk_rows)
    return blocks


def distinct_teacher_rows(teacher_rows: torch.Tensor, chunk_rows: int) -> TeacherRows:
    """Each chunk of ``chunk_rows`` labelled rows' distinct teacher rows (host tensors in, host tensors out).

    Slot k of anchor p reads the target at p + k, so blocks whose anchors lie closer than B tokens share teacher
    rows: at 512 anchors in a 3,072-token sample (block 16, chunks of 1,024 rows) 3,002 of 8,181 labelled rows are
    distinct, and the teacher's pass through the LM head, three quarters of what DSpark adds to DFlash's counted
    FLOPs, shrinks with them (docs/FLOPS.md)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows, index, offsets = [], [], [0]
    for start in range(0, teacher_rows.shape[0], chunk_rows):
        distinct, local = torch.unique(teacher_rows[start : start + chunk_rows], sorted=True, return_inverse=True)
        rows.append(distinct)
        index.append(local)
        offsets.append(offsets[-1] + distinct.shape[0])
    empty = teacher_rows.new_zeros(0)
    return TeacherRows(chunk_rows, torch.cat(rows) if rows else empty, torch.cat(index) if index else empty,
                       tuple(offsets))
