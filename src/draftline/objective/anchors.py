"""Anchor sampling: which positions start a training block.

Per DOCUMENT (not per packed row: that starves short conversations), up to ``max_anchors``
positions ``p`` with ``loss_mask[p]`` and ``loss_mask[p + 1]`` set, sampled uniformly without
replacement. The draw depends only on (seed, epoch, sample id), so a document gets the same anchors
whichever batch, rank or resume it lands in, and new ones every epoch.
"""

from __future__ import annotations

import hashlib

import torch

from draftline.data.batch import PackedBatch


def anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def eligible_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p of one document with loss_mask[p] and loss_mask[p + 1], [n]."""
    if loss_mask.shape[0] < 2:
        return torch.zeros(0, dtype=torch.long)
    ok = loss_mask[:-1] & loss_mask[1:]
    return torch.nonzero(ok, as_tuple=False).flatten()


def sample_anchors(batch: PackedBatch, max_anchors: int, seed: int) -> torch.Tensor:
    """Flat token indices of the anchors of ``batch``, sorted (so grouped by document), [N].

    Runs on the host from CPU tensors.
    """
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    loss_mask = batch.loss_mask.cpu()
    starts = batch.doc_starts().tolist()
    lengths = batch.doc_lengths.tolist()
    sample_ids = batch.sample_ids.tolist()
    picked = []
    generator = torch.Generator()
    for start, length, sid in zip(starts, lengths, sample_ids):
        eligible = eligible_anchor_positions(loss_mask[start : start + length])
        if eligible.numel() == 0:
            continue
        if eligible.numel() > max_anchors:
            generator.manual_seed(anchor_seed(seed, batch.epoch, sid))
            choice = torch.randperm(eligible.numel(), generator=generator)[:max_anchors]
            eligible = eligible[choice].sort().values
        picked.append(eligible + start)
    if not picked:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(picked)


def chained_block_starts(accept_lengths: torch.Tensor) -> torch.Tensor:
    """Where greedy speculative decoding starts its blocks over one run of consecutive positions.

    ``accept_lengths[i]`` (1..B) is the teacher-forced acceptance length of a block anchored at
    the run's i-th position: 1 + the number of leading slots the drafter got right. Decoding the
    same tokens, the first block starts at 0 and each next one right after the last committed
    token: ``i + accept_lengths[i]``. Returns those indices, [n_blocks] (int64).
    """
    lengths = accept_lengths.tolist()
    starts, i = [], 0
    while i < len(lengths):
        starts.append(i)
        step = int(lengths[i])
        if step < 1:
            raise ValueError(f"acceptance lengths must be >= 1, got {step} at index {i}")
        i += step
    return torch.tensor(starts, dtype=torch.long)


def eligible_anchors(batch: PackedBatch) -> torch.Tensor:
    """Every eligible anchor of ``batch`` as flat token indices, sorted (``sample_anchors`` without a cap)."""
    loss_mask = batch.loss_mask.cpu()
    picked = [eligible_anchor_positions(loss_mask[s : s + n]) + s
              for s, n in zip(batch.doc_starts().tolist(), batch.doc_lengths.tolist())]
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
