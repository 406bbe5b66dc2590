"""The prepared dataset on disk: each sample's anchor positions come from its loss mask as the objective counts them."""

from __future__ import annotations

import numpy as np
import torch

from draftline.data.dataset import DatasetWriter, TokenDataset
from draftline.objective.anchors import eligible_anchor_positions


def test_anchor_positions_match_the_objectives_count(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=200)
    lengths[:3] = [1, 2, 3]  # no pair, one pair, two pairs at most
    total = int(lengths.sum())
    mask = rng.random(total) < 0.7
    writer = DatasetWriter(tmp_path / "ds", vocab_size=1000)
    writer.add(rng.integers(0, 1000, total), mask, lengths)
    writer.finish({"target_vocab_size": 1000})
    dataset = TokenDataset(tmp_path / "ds")
    expected = [len(eligible_anchor_positions(torch.from_numpy(dataset[i][1]))) for i in range(len(dataset))]
    got = dataset.anchor_positions()
    assert got.tolist() == expected
    assert got[0] == 0 and sum(expected) > 0
    assert dataset.anchor_positions() is got  # read once
