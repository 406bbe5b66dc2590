"""Where greedy decoding starts its blocks along teacher-forced acceptance lengths (evaluate/teacher_forced.py)."""

from __future__ import annotations

import pytest
import torch

from draftline.objective.anchors import chained_block_starts


def test_chained_block_starts_follow_the_committed_lengths():
    # A block at 0 commits 3 tokens: the next starts at 3; 3 commits 1: next at 4; 4 commits 4: next at 8 (past the end).
    lengths = torch.tensor([3, 8, 8, 1, 4, 2, 2, 2])
    assert chained_block_starts(lengths).tolist() == [0, 3, 4]
    assert chained_block_starts(torch.ones(5, dtype=torch.long)).tolist() == [0, 1, 2, 3, 4]
    assert chained_block_starts(torch.zeros(0, dtype=torch.long)).tolist() == []
    with pytest.raises(ValueError, match=">= 1"):
        chained_block_starts(torch.tensor([2, 0, 0]))
