"""Anchors, labels and weights: the DFlash objective's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.objective.anchors import sample_anchors
from draftline.objective.blocks import build_blocks, position_weights

MASK = 999


def test_labels_are_same_position_tokens_not_shifted():
    ids = list(range(100, 120))
    batch = PackedBatch.from_documents([(ids, [True] * 20)])
    blocks = build_blocks(batch, torch.tensor([4]), block_size=5, mask_token_id=MASK, gamma=4.0)
    assert blocks.block_input_ids.tolist() == [104, MASK, MASK, MASK, MASK]
    assert blocks.block_positions.tolist() == [4, 5, 6, 7, 8]
    # Slot k of anchor p is labelled x_{p+k}: rows 1..4 -> tokens 105..108 (a shifted trainer would give 106..109).
    assert blocks.label_rows.tolist() == [1, 2, 3, 4]
    assert blocks.labels.tolist() == [105, 106, 107, 108]


def test_labels_respect_loss_mask_and_document_end():
    doc0 = (list(range(10, 18)), [False, False, True, True, True, False, True, True])
    doc1 = (list(range(50, 56)), [True] * 6)
    batch = PackedBatch.from_documents([doc0, doc1])
    blocks = build_blocks(batch, torch.tensor([3, 6]), block_size=4, mask_token_id=MASK, gamma=4.0)
    # Anchor 3: slots 1..3 -> positions 4 (mask on), 5 (off), 6 (on).
    # Anchor 6: slots 1..3 -> position 7 (on); 8 and 9 are past doc 0's end (doc 1's tokens must not leak in).
    assert blocks.label_rows.tolist() == [1, 3, 5]
    assert blocks.labels.tolist() == [14, 16, 17]


def test_position_weights_decay_and_slot_zero_has_none():
    w = position_weights(16, 7.0)
    assert w[0] == 0
    assert w[1] == pytest.approx(1.0)
    assert w[15] == pytest.approx(math.exp(-14 / 7))


def test_anchor_eligibility_needs_two_trainable_positions():
    mask = [False, True, True, False, True, False, True, True, True]
    batch = PackedBatch.from_documents([(list(range(9)), mask)])
    anchors = sample_anchors(batch, max_anchors=100, seed=0)
    assert anchors.tolist() == [1, 6, 7]


def test_anchor_budget_is_per_document_not_per_row():
    long = (list(range(400)), [True] * 400)
    shorts = [(list(range(30)), [True] * 30) for _ in range(5)]
    batch = PackedBatch.from_documents([long, *shorts])
    anchors = sample_anchors(batch, max_anchors=16, seed=0)
    doc = batch.doc_ids()[anchors]
    counts = torch.bincount(doc, minlength=6).tolist()
    assert counts == [16] * 6  # every short conversation gets its own budget


def test_anchors_depend_on_seed_epoch_and_sample_id_only():
    a = (list(range(200)), [True] * 200)
    b = (list(range(90)), [True] * 90)
    one = PackedBatch.from_documents([a, b], sample_ids=[7, 8], epoch=2)
    other = PackedBatch.from_documents([b, a], sample_ids=[8, 7], epoch=2)
    x = sample_anchors(one, 10, seed=5)
    y = sample_anchors(other, 10, seed=5)
    assert x[:10].tolist() == (y[10:] - 90).tolist()  # doc 7's anchors, wherever it sits
    next_epoch = PackedBatch.from_documents([a, b], sample_ids=[7, 8], epoch=3)
    assert sample_anchors(next_epoch, 10, seed=5).tolist() != x.tolist()
    assert sample_anchors(one, 10, seed=6).tolist() != x.tolist()


def test_teacher_rows_are_the_tokens_that_predict_each_label():
    """Soft labels read the target's output at p+k-1, the token just before the label, same document."""
    doc0 = (list(range(10, 18)), [False, False, True, True, True, False, True, True])
    doc1 = (list(range(50, 56)), [True] * 6)
    batch = PackedBatch.from_documents([doc0, doc1])
    blocks = build_blocks(batch, torch.tensor([3, 6, 9]), block_size=4, mask_token_id=MASK, gamma=4.0)
    ids, docs = batch.input_ids, batch.doc_ids()
    rows = blocks.teacher_rows
    assert torch.equal(ids[rows + 1], blocks.labels)
    assert torch.equal(docs[rows], docs[rows + 1])
    anchors = torch.tensor([3, 6, 9])[blocks.label_rows // 4]
    assert torch.all(rows >= anchors)  # never before the block's own anchor
