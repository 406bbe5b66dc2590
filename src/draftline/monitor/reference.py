"""The reference workload: one mean-length document per sample (docs/FLOPS.md).

What the line's ETA before the first step and ``draftline plan`` use when no measured batch is at
hand: a sample is one document of ``mean_length`` tokens (2,826: the mean of the reference
pipeline's data), all of it context for the drafter, with ``num_anchors`` anchors spread evenly.
"""

from __future__ import annotations

import torch

from draftline.monitor.flops import drafter_flops, target_flops
from draftline.monitor.shapes import DecoderShape, DrafterShape

MEAN_LENGTH = 2826


def reference_target_flops(shape: DecoderShape, num_layers_run: int, mean_length: int = MEAN_LENGTH) -> float:
    """Target FLOPs of one sample of the reference workload (one document)."""
    return target_flops(shape, [mean_length], num_layers_run)


def reference_drafter_flops(
    shape: DrafterShape,
    mean_length: int = MEAN_LENGTH,
    num_anchors: int = 512,
    prompt_length: int = 0,
) -> float:
    """Drafter FLOPs of one sample of the reference workload.

    One document of ``mean_length`` tokens, all of them context rows; anchors spread evenly over
    positions ``prompt_length .. mean_length - 1`` (0: mean position (L-1)/2); every non-anchor
    slot labelled (N x (B-1) rows).
    """
    if not 0 < num_anchors <= mean_length - prompt_length:
        raise ValueError(f"{num_anchors} anchors do not fit in {mean_length - prompt_length} response positions")
    positions = torch.linspace(prompt_length, mean_length - 1, num_anchors, dtype=torch.float64)
    return drafter_flops(
        shape,
        num_context_rows=mean_length,
        anchor_positions=positions,
        num_labelled_rows=num_anchors * (shape.block_size - 1),
    )
