"""Training metrics kept on the device: one flat vector per pass, summed across passes and ranks.

Layout of the vector (float64 so sums over a long run stay exact enough):
``[loss_sum, weight_sum, num_labels, num_blocks, acceptance_sum, correct[0..B), count[0..B)]``.
Nothing here reads a value back to the host; ``summarize`` does, once, at logging time.
"""

from __future__ import annotations

import torch

LOSS_SUM, WEIGHT_SUM, NUM_LABELS, NUM_BLOCKS, ACCEPT_SUM = range(5)
_HEAD = 5


def metrics_size(block_size: int) -> int:
    return _HEAD + 2 * block_size


def pass_metrics(
    loss_sum: torch.Tensor,
    correct: torch.Tensor,
    label_rows: torch.Tensor,
    label_weights: torch.Tensor,
    num_anchors: int,
    block_size: int,
    first_slot: int = 1,
) -> torch.Tensor:
    """The metrics vector of one pass; ``correct`` is the top-1 hit of each labelled row. ``first_slot``: the
    block's first drafted slot (DFlash 1: slot 0 is the anchor; DSpark 0: the anchor's slot drafts too).

    Host numbers enter through ``fill_``/``index_fill_`` (a kernel argument): assigning a Python
    number into a CUDA tensor copies it from the host and synchronises the stream."""
    device = correct.device
    out = torch.zeros(metrics_size(block_size), dtype=torch.float64, device=device)
    hits = torch.zeros(num_anchors * block_size, dtype=torch.float64, device=device)
    hits[label_rows] = correct.double()
    count = torch.zeros_like(hits)
    count.index_fill_(0, label_rows, 1.0)
    hits = hits.view(num_anchors, block_size)
    # Expected acceptance of a block: 1 + sum_k prod_{i<=k} hit_i. An unlabelled slot counts as a
    # miss, which under-estimates blocks that run into a document's end.
    accept = 1.0 + torch.cumprod(hits[:, first_slot:], dim=1).sum(dim=1)
    out[LOSS_SUM] = loss_sum.double()
    out[WEIGHT_SUM] = label_weights.double().sum()
    out[NUM_LABELS].fill_(float(label_rows.shape[0]))
    out[NUM_BLOCKS].fill_(float(num_anchors))
    out[ACCEPT_SUM] = accept.sum()
    out[_HEAD : _HEAD + block_size] = hits.sum(0)
    out[_HEAD + block_size :] = count.view(num_anchors, block_size).sum(0)
    return out


SUMMARY_KEYS = ("loss", "accuracy", "accuracy_by_position", "tf_acceptance", "num_blocks", "num_labels", "weight_sum")
"""What ``summarize`` returns; a method's summary adds its own keys after these (the monitor logs them as they are)."""


def summarize(vector: torch.Tensor, block_size: int, first_slot: int = 1) -> dict:
    """Host-side summary: loss (per unit weight), accuracy per slot (from ``first_slot``, see ``pass_metrics``),
    teacher-forced acceptance. Entries after the ``metrics_size`` head (a method's own) are not read.

    ``tf_acceptance`` is the mean of ``1 + sum_k prod_{i<=k} hit_i`` over the training blocks, whose
    anchors are drawn uniformly. It is NOT what decoding gets: there every block starts right after
    a rejection, where the drafter does worse; the measured ``tau`` (evaluation) is often far lower.
    """
    v = vector.detach().double().cpu()  # syncs with the device: call at logging time only
    weight = float(v[WEIGHT_SUM])
    blocks = float(v[NUM_BLOCKS])
    correct = v[_HEAD : _HEAD + block_size]
    count = v[_HEAD + block_size : _HEAD + 2 * block_size]
    acc = [float(c / n) if n > 0 else float("nan") for c, n in zip(correct[first_slot:], count[first_slot:])]
    return {
        "loss": float(v[LOSS_SUM]) / weight if weight > 0 else float("nan"),
        "accuracy": float(correct.sum() / count.sum()) if count.sum() > 0 else float("nan"),
        "accuracy_by_position": acc,
        "tf_acceptance": float(v[ACCEPT_SUM]) / blocks if blocks > 0 else float("nan"),
        "num_blocks": int(blocks),
        "num_labels": int(v[NUM_LABELS]),
        "weight_sum": weight,
    }
