"""D-PACE: each label's cross-entropy weighted by how much it moves the block's expected acceptance.

D-PACE (arXiv 2605.18810) replaces DFlash's fixed ``exp(-(k-1)/gamma)`` position weights by weights the
drafter's own predictions set, detached: with ``q_k = exp(-CE_k)`` the drafter's probability of slot
``k``'s label and ``s_k = (1 - alpha) q_k + alpha`` its smoothed acceptance,

    P_k = prod_{i <= k} s_i          (the smoothed chance that the block is accepted up to slot k)
    w_k = sum_{m >= k} P_m           (the accepted length that slot k holds up)

and the loss is ``sum_k w_k CE_k`` over the labelled slots. A slot without a label counts as ``s = 1``
in the products and adds nothing to the sums. The weights are computed from the forward's own
cross-entropies (``head_loss.chunked_head_loss``'s ``weigh``), so they cost no second pass over the head.
"""

from __future__ import annotations

import torch


def dpace_weights(ce: torch.Tensor, label_rows: torch.Tensor, num_anchors: int, block_size: int,
                  alpha: float) -> torch.Tensor:
    """The D-PACE weight of each labelled row, [M], detached.

    ``ce`` [M] is each labelled row's cross-entropy, ``label_rows`` [M] its row in the anchor-major
    layout (row = anchor * block_size + slot, ``objective.blocks.BlockBatch``).
    """
    ce = ce.detach()
    rows = num_anchors * block_size
    smooth = torch.ones(rows, dtype=ce.dtype, device=ce.device)
    smooth[label_rows] = (1.0 - alpha) * torch.exp(-ce) + alpha
    labelled = torch.zeros(rows, dtype=ce.dtype, device=ce.device)
    labelled.index_fill_(0, label_rows, 1.0)  # no host-to-device copy of the 1.0 (a sync)
    prefix = torch.cumprod(smooth.view(num_anchors, block_size), dim=1)
    reach = (prefix * labelled.view(num_anchors, block_size)).flip(1).cumsum(1).flip(1)
    return reach.reshape(-1)[label_rows]
