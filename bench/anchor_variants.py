"""Anchors where greedy decoding starts its blocks: an objective variant measured in bench/objective_sweep.py
(README's demo table: 16 per document lost 0.04 tau, all of them gained 0.11 for ~2.3x the drafter's rows, less
than the same compute spent on epochs), not adopted; kept here for the sweep."""

from __future__ import annotations

import torch

from draftline.data.batch import PackedBatch
from draftline.objective.anchors import anchor_seed, chained_block_starts, eligible_anchor_positions


def chained_anchors(batch: PackedBatch, accept_lengths: torch.Tensor, max_anchors: int, seed: int = 0) -> torch.Tensor:
    """Anchors where inference would start blocks: per document, chained from its first eligible
    position along ``accept_lengths`` (one entry per position of ``eligible_anchors(batch)``,
    the drafter's current teacher-forced acceptance there); a document with more keeps a uniform
    draw of ``max_anchors`` of them (seeded like ``sample_anchors``).

    Runs on the host. Used to train on the positions decoding visits (right after a rejection)
    instead of uniform ones.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    loss_mask = batch.loss_mask.cpu()
    picked, offset = [], 0
    generator = torch.Generator()
    for start, length, sid in zip(batch.doc_starts().tolist(), batch.doc_lengths.tolist(), batch.sample_ids.tolist()):
        eligible = eligible_anchor_positions(loss_mask[start : start + length])
        lengths = accept_lengths[offset : offset + eligible.numel()]
        offset += eligible.numel()
        if eligible.numel() == 0:
            continue
        # A chain runs over consecutive eligible positions; a gap (a prompt turn) restarts it.
        breaks = torch.nonzero(eligible[1:] != eligible[:-1] + 1, as_tuple=False).flatten() + 1
        bounds = [0, *breaks.tolist(), eligible.numel()]
        chosen = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            chosen.append(eligible[lo:hi][chained_block_starts(lengths[lo:hi])])
        chosen = torch.cat(chosen)
        if chosen.numel() > max_anchors:
            generator.manual_seed(anchor_seed(seed, batch.epoch, sid))
            chosen = chosen[torch.randperm(chosen.numel(), generator=generator)[:max_anchors]].sort().values
        picked.append(chosen + start)
    if offset != accept_lengths.numel():
        raise ValueError(f"accept_lengths has {accept_lengths.numel()} entries, the batch {offset} eligible positions")
    if not picked:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(picked)
