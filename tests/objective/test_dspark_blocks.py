"""DSpark's slot layout: slot k of anchor p predicts x_{p+k+1}, reads x_{p+k}, stops at the first unlabelled slot."""

from __future__ import annotations

import math

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.objective.blocks import build_blocks
from draftline.objective.dspark_blocks import build_dspark_blocks, default_dspark_gamma, dspark_position_weights

MASK = 99


def _batch():
    # doc 0: 10 tokens, token 6 masked out (e.g. a turn boundary); doc 1: 5 tokens, all trained.
    ids = [list(range(10, 20)), list(range(50, 55))]
    masks = [[i not in (0, 6) for i in range(10)], [True] * 5]
    return PackedBatch.from_documents(list(zip(ids, masks)), sample_ids=[0, 1])


def test_labels_previous_tokens_teacher_rows_and_the_cut():
    batch = _batch()
    anchors = torch.tensor([1, 4, 11])  # doc 0 at 1 and 4; doc 1 (starts at 10) at position 1
    blocks = build_dspark_blocks(batch, anchors, block_size=4, mask_token_id=MASK, gamma=4.0)
    rows = blocks.label_rows.tolist()
    # anchor 1: labels x2..x5 (all trained); anchor 4: x5 then x6 masked -> cut after slot 0;
    # anchor 11 (doc 1 pos 1): x12, x13, x14, then the document ends.
    assert rows == [0, 1, 2, 3, 4, 8, 9, 10]
    assert blocks.labels.tolist() == [12, 13, 14, 15, 15, 52, 53, 54]
    assert blocks.prev_ids.tolist() == [11, 12, 13, 14, 14, 51, 52, 53]
    assert blocks.teacher_rows.tolist() == [1, 2, 3, 4, 4, 11, 12, 13]  # token p + k predicts slot k's label
    slot = torch.tensor(rows) % 4
    torch.testing.assert_close(blocks.label_weights, torch.exp(-slot.float() / 4.0))
    assert blocks.block_input_ids.view(3, 4)[:, 0].tolist() == [11, 14, 51]
    assert (blocks.block_input_ids.view(3, 4)[:, 1:] == MASK).all()
    assert blocks.block_positions.view(3, 4)[2].tolist() == [1, 2, 3, 4]


def test_a_label_after_a_gap_is_not_trained():
    """A masked-out token inside a block ends its supervision even where later tokens are trained again."""
    batch = _batch()
    blocks = build_dspark_blocks(batch, torch.tensor([3]), block_size=6, mask_token_id=MASK, gamma=math.inf)
    assert blocks.labels.tolist() == [14, 15]  # x4, x5; x6 is masked, x7.. are cut
    assert blocks.label_weights.tolist() == [1.0, 1.0]


def test_layout_and_visibility_are_dflashs():
    """Inputs, positions and the attention layout are DFlash's; only the labels move by one slot."""
    batch, anchors = _batch(), torch.tensor([1, 2, 11])
    ours = build_dspark_blocks(batch, anchors, block_size=4, mask_token_id=MASK, gamma=4.0)
    theirs = build_blocks(batch, anchors, block_size=4, mask_token_id=MASK, gamma=7.0)
    for name in ("block_input_ids", "block_positions", "context_positions"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name))
    for name in ("context_doc", "context_pos", "anchor_doc", "anchor_pos"):
        assert torch.equal(getattr(ours.layout, name), getattr(theirs.layout, name))
    moved = ours.to("cpu")
    assert torch.equal(moved.prev_ids, ours.prev_ids) and moved.num_anchors == 3


def test_weights_from_slot_zero_and_the_default_gamma():
    assert default_dspark_gamma(7) == default_dspark_gamma(16) == 4.0
    torch.testing.assert_close(dspark_position_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_each_loss_chunk_s_distinct_teacher_rows():
    """Teacher rows [1, 2, 3, 4, 4, 11, 12, 13] (above) in chunks of 3 labelled rows: [1, 2, 3], [4, 4, 11] and
    [12, 13]; a chunk's repeated row (4: slot 3 of anchor 1 and slot 0 of anchor 4) is computed once."""
    from draftline.objective.dspark_blocks import distinct_teacher_rows

    blocks = build_dspark_blocks(_batch(), torch.tensor([1, 4, 11]), block_size=4, mask_token_id=MASK, gamma=4.0,
                                 chunk_rows=3)
    teacher = blocks.teacher
    assert teacher.chunk_rows == 3 and teacher.offsets == (0, 3, 5, 7)
    assert teacher.rows.tolist() == [1, 2, 3, 4, 11, 12, 13]
    assert teacher.index.tolist() == [0, 1, 2, 0, 0, 1, 0, 1]  # each row's among its own chunk's
    for c, start in enumerate(range(0, 8, 3)):  # every row reads its own teacher row back
        chunk_rows = teacher.rows[teacher.offsets[c] : teacher.offsets[c + 1]]
        assert chunk_rows[teacher.index[start : start + 3]].tolist() == blocks.teacher_rows[start : start + 3].tolist()
    moved = blocks.to("cpu")
    assert moved.teacher.offsets == teacher.offsets and torch.equal(moved.teacher.index, teacher.index)
    assert build_dspark_blocks(_batch(), torch.tensor([1]), block_size=4, mask_token_id=MASK, gamma=4.0).teacher is None
    empty = distinct_teacher_rows(torch.zeros(0, dtype=torch.long), 4)
    assert empty.offsets == (0,) and empty.rows.numel() == 0
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        distinct_teacher_rows(blocks.teacher_rows, 0)
