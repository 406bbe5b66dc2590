"""Anchors where decoding would start blocks (chained along teacher-forced acceptance lengths).

Run by hand with the sweep it serves: pytest bench/test_anchor_variants.py"""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_variants import chained_anchors  # noqa: E402
from draftline.objective.anchors import eligible_anchors, sample_anchors  # noqa: E402



def _batch():
    # doc 0: prompt 3 tokens, response 7; doc 1: prompt 2, response 5, a user turn of 2, response 4.
    masks = [[0] * 3 + [1] * 7, [0] * 2 + [1] * 5 + [0] * 2 + [1] * 4]
    docs = [(list(range(10, 10 + len(m))), [bool(x) for x in m]) for m in masks]
    return PackedBatch.from_documents(docs)


def test_eligible_anchors_are_sample_anchors_without_a_cap():
    batch = _batch()
    every = eligible_anchors(batch)
    assert every.tolist() == sample_anchors(batch, 10_000, seed=0).tolist()
    # response positions p with p + 1 also in the response, flat indices (doc 1 starts at 10)
    assert every.tolist() == [3, 4, 5, 6, 7, 8] + [12, 13, 14, 15] + [19, 20, 21]


def test_chained_anchors_restart_at_each_response_and_respect_the_cap():
    batch = _batch()
    lengths = torch.tensor([2, 9, 1, 3, 9, 9] + [4, 9, 9, 9] + [1, 1, 1])
    assert chained_anchors(batch, lengths, max_anchors=100).tolist() == [3, 5, 6] + [12] + [19, 20, 21]
    capped = chained_anchors(batch, lengths, max_anchors=2, seed=1)
    assert capped.tolist() == sorted(capped.tolist()) and len(capped) == 4  # 2 of doc 0's 3, 2 of doc 1's 4
    assert set(capped.tolist()) <= {3, 5, 6, 12, 19, 20, 21}
    assert capped.tolist() == chained_anchors(batch, lengths, max_anchors=2, seed=1).tolist()  # seeded
    with pytest.raises(ValueError, match="eligible positions"):
        chained_anchors(batch, lengths[:-1], max_anchors=4)
