"""The metrics vector: the first drafted slot (DFlash 1, DSpark 0), and a method's own entries after the head."""

from __future__ import annotations

import torch

from draftline.objective.metrics import ACCEPT_SUM, metrics_size, pass_metrics, summarize


def test_first_slot_sets_acceptance_and_accuracy_by_position():
    # 2 blocks of 3 slots; every slot labelled; hits: block 0 [1, 1, 0], block 1 [0, 1, 1].
    rows = torch.arange(6)
    correct = torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool)
    weights = torch.ones(6)
    dflash = pass_metrics(torch.tensor(1.0), correct, rows, weights, 2, 3)
    dspark = pass_metrics(torch.tensor(1.0), correct, rows, weights, 2, 3, first_slot=0)
    assert float(dflash[ACCEPT_SUM]) == (1 + 1) + (1 + 2)  # slots 1.. : [1, 0] -> 1; [1, 1] -> 2
    assert float(dspark[ACCEPT_SUM]) == (1 + 2) + (1 + 0)  # slots 0.. : [1, 1, 0] -> 2; [0, ...] -> 0
    assert summarize(dflash, 3)["accuracy_by_position"] == [1.0, 0.5]
    assert summarize(dspark, 3, first_slot=0)["accuracy_by_position"] == [0.5, 1.0, 0.5]


def test_entries_after_the_head_are_not_read():
    rows = torch.arange(4)
    vector = pass_metrics(torch.tensor(2.0), torch.ones(4, dtype=torch.bool), rows, torch.ones(4), 1, 4)
    longer = torch.cat([vector, torch.tensor([7.0, 9.0], dtype=torch.float64)])
    assert vector.shape == (metrics_size(4),)
    assert summarize(longer, 4) == summarize(vector, 4)
