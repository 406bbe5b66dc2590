"""Training blocks: inputs, positions, labels and loss weights for every anchor of a batch.

Block of anchor p (docs/OBJECTIVE.md): input ``[x_p, MASK x (B-1)]`` at positions ``p .. p+B-1``;
slot k (1..B-1) is labelled with the data's own token ``x_{p+k}`` (same position: NOT shifted), kept
only when ``loss_mask[p+k]`` is set and ``p+k`` is inside the document; slot 0 has no label. Weight
of slot k: ``exp(-(k-1) / gamma)``. The target predicted that label at token ``p+k-1``: its final
hidden state there gives the soft label (``teacher_rows``).

Everything here is built on the host from CPU tensors and moved to the device in one go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from draftline.data.batch import PackedBatch
from draftline.model.attention import BlockLayout


@dataclass
class TeacherRows:
    """The distinct teacher rows of each chunk of labelled rows: a chunk's labels come from overlapping blocks
    (anchors a few tokens apart, each block B rows long), so many of its rows share a teacher token, whose
    logits the loss then computes once. Chunk ``c`` covers labelled rows ``[c * chunk_rows, (c + 1) *
    chunk_rows)`` and its distinct rows are ``rows[offsets[c]:offsets[c + 1]]``."""

    chunk_rows: int
    rows: torch.Tensor  # [U] int64, the chunks' distinct teacher rows, chunk after chunk
    index: torch.Tensor  # [M] int64, each labelled row's teacher among its chunk's distinct rows (chunk-local)
    offsets: tuple[int, ...]  # host ints, one more than the chunks


@dataclass
class BlockBatch:
    """All blocks of one batch, rows ordered anchor-major (row = a * B + k)."""

    layout: BlockLayout
    block_input_ids: torch.Tensor  # [N * B] int64
    block_positions: torch.Tensor  # [N * B] int64
    context_positions: torch.Tensor  # [T] int64
    label_rows: torch.Tensor  # [M] int64, rows with a valid label
    labels: torch.Tensor  # [M] int64
    label_weights: torch.Tensor  # [M] float32
    teacher_rows: torch.Tensor  # [M] int64, the token whose target output predicts each label
    num_anchors: int
    block_size: int
    prev_ids: torch.Tensor | None = None  # [M] int64, the token before each label (DSpark's Markov input)
    teacher: "TeacherRows | None" = None  # DSpark: each loss chunk's distinct teacher rows (objective.dspark_blocks)

    def _map(self, fn, layout: BlockLayout) -> "BlockBatch":
        tensors = {f.name: fn(getattr(self, f.name)) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        teacher = None if self.teacher is None else replace(self.teacher, rows=fn(self.teacher.rows),
                                                            index=fn(self.teacher.index))
        return replace(self, layout=layout, teacher=teacher, **tensors)

    def to(self, device: torch.device | str) -> "BlockBatch":
        return self._map(lambda t: t.to(device, non_blocking=True), self.layout.to(device))

    def pin_memory(self) -> "BlockBatch":
        if not torch.cuda.is_available():
            return self
        pin = lambda t: t.pin_memory()  # noqa: E731
        layout = BlockLayout(
            pin(self.layout.context_doc),
            pin(self.layout.context_pos),
            pin(self.layout.anchor_doc),
            pin(self.layout.anchor_pos),
            self.layout.block_size,
        )
        return self._map(pin, layout)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of each block slot, [B]; slot 0 (the anchor) has weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def build_blocks(
    batch: PackedBatch,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    """Blocks for ``anchors`` (flat token indices into ``batch``, sorted), on the host."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    check_gamma(gamma)
    # Label of slot k is the token at the same position, x_{p+k}: the target's next-token at p+k-1.
    return labelled_blocks(batch, anchors, block_size=block_size, mask_token_id=mask_token_id,
                           weights=position_weights(block_size, gamma), label_offset=0)


def check_gamma(gamma: float) -> None:
    """A block's position weights need a positive decay constant."""
    if math.isnan(gamma) or gamma <= 0:
        raise ValueError(f"gamma must be a positive number (inf: every label weight 1), got {gamma}")


def labelled_blocks(batch: PackedBatch, anchors: torch.Tensor, *, block_size: int, mask_token_id: int,
                    weights: torch.Tensor, label_offset: int, stop_at_first_gap: bool = False,
                    with_prev_ids: bool = False) -> BlockBatch:
    """The blocks of ``anchors``: inputs ``[x_p, MASK x (B-1)]`` at positions ``p .. p+B-1``; slot k's label the
    token at ``p + k + label_offset`` where it lies in the anchor's document, past the anchor, and in the loss mask
    (``stop_at_first_gap``: no slot after an unlabelled one is labelled); ``weights`` [B] per slot;
    ``with_prev_ids``: the token before each label (``BlockBatch.prev_ids``)."""
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

    label_index = anchors[:, None] + slots[None, :] + label_offset  # [N, B]
    inside = (label_index < doc_end[anchor_doc][:, None]) & (label_index > anchors[:, None])
    safe_index = label_index.clamp(max=num_tokens - 1)
    valid = inside & loss_mask[safe_index]
    if stop_at_first_gap:
        valid = valid.to(torch.int32).cumprod(dim=1).bool()
    weights = weights[None, :].expand(num_anchors, block_size)

    label_rows = torch.nonzero(valid.reshape(-1), as_tuple=False).flatten()
    label_tokens = safe_index.reshape(-1)[label_rows]
    teacher_rows = label_tokens - 1  # the target's output there predicts the label
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
        prev_ids=input_ids[teacher_rows] if with_prev_ids else None,
    )


@dataclass
class Pass:
    """One forward/backward over a contiguous run of anchors of a batch."""

    batch: PackedBatch  # the documents the pass needs (whole documents)
    anchors: torch.Tensor  # flat indices into ``batch``
    token_lo: int  # offset of ``batch`` in the full batch (to slice the features)
    token_hi: int


def plan_passes(batch: PackedBatch, anchors: torch.Tensor, max_anchors_per_pass: int, block_size: int = 16,
                max_dense_entries: int | None = None) -> list[Pass]:
    """Split a batch's anchors (sorted) into passes of at most ``max_anchors_per_pass``.

    With ``max_dense_entries`` (the dense attention path, which computes every query-key pair), a
    pass also ends before its mask ``block rows x (context rows + block rows)`` would exceed it:
    documents then go through in small groups instead of one quadratic pass.
    """
    if anchors.numel() == 0:
        return []
    doc_of_token = batch.doc_ids()
    starts = batch.doc_starts()
    ends = starts + batch.doc_lengths
    anchor_doc = doc_of_token[anchors].tolist()
    passes = []
    lo = 0
    total = anchors.numel()
    while lo < total:
        hi = min(lo + max_anchors_per_pass, total)
        if max_dense_entries is not None:
            first_doc = anchor_doc[lo]
            end = lo + 1
            while end < hi:
                rows = (end + 1 - lo) * block_size
                context = int(ends[anchor_doc[end]] - starts[first_doc])
                if rows * (context + rows) > max_dense_entries:
                    break
                end += 1
            hi = end
        chunk = anchors[lo:hi]
        first_doc, last_doc = anchor_doc[lo], anchor_doc[hi - 1]
        token_lo, token_hi = int(starts[first_doc]), int(ends[last_doc])
        sub = batch.slice_docs(first_doc, last_doc + 1)
        passes.append(Pass(sub, chunk - token_lo, token_lo, token_hi))
        lo = hi
    return passes
