"""The reference workload, defined once: its length mix, its synthetic batches, its FLOPs per sample.

What sizing uses when no measured batch is at hand (docs/FLOPS.md), and what every synthetic batch of
the project is made of (``draftline plan``'s rates and ``--measure``, preflight's worst case, bench/):

- The length mix: log-normal document lengths around ``MEAN_LENGTH`` tokens (2,826: the mean of the
  reference pipeline's data), sigma ``LENGTH_SIGMA``, within ``MIN_LENGTH .. MAX_LENGTH``; the first
  ``PROMPT_SHARE`` of each document is its prompt, the rest is trained. ``reference_lengths`` is a fixed
  sample of it (the planner's rates), ``draw_length`` one length at a time.
- Synthetic batches: ``packed_batch`` packs documents of given lengths with random tokens;
  ``fill_budget`` takes lengths in order while they fit a token budget (``lognormal_lengths``: from the
  mix, ``sampled_batches``: from given lengths); ``worst_case_batch`` is preflight's, documents of
  ``DOC_TOKENS`` tokens, every token trained.
- FLOPs per sample: one document of the mean length, all of it context for the drafter, with
  ``num_anchors`` anchors spread evenly (``reference_target_flops``, ``reference_drafter_flops``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from draftline.data.batch import PackedBatch
from draftline.sizing.flops import drafter_flops, target_flops
from draftline.sizing.shapes import DecoderShape, DrafterShape

MEAN_LENGTH = 2826
"""Tokens per document, the mean of the reference pipeline's data."""
LENGTH_SIGMA = 0.6
"""The spread of the log-normal length mix."""
MIN_LENGTH, MAX_LENGTH = 64, 8192
"""The mix's documents are kept within these lengths."""
PROMPT_SHARE = 0.2
"""The first fifth of a document is its prompt (no loss, no anchors); the rest is trained."""
DOC_TOKENS = 2048
"""Tokens per document of preflight's worst-case batch: flex attention materialises no score matrix, so
memory does not depend on how tokens split into documents, while one document of the whole budget would
cost quadratic attention time (minutes at 262K tokens) to learn nothing more."""


# ------------------------------------------------------------------------------------------ the length mix
def _mu(mean_length: float) -> float:
    """The log-normal's location for a mean of ``mean_length``."""
    return math.log(mean_length) - LENGTH_SIGMA**2 / 2


def reference_lengths(mean_length: int = MEAN_LENGTH, count: int = 512) -> np.ndarray:
    """``count`` lengths of the mix around ``mean_length`` (seeded: the same sample every time)."""
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(_mu(mean_length), LENGTH_SIGMA, count), MIN_LENGTH, MAX_LENGTH).astype(int)


def draw_length(rng: np.random.Generator, mean_length: float = MEAN_LENGTH, cap: int = MAX_LENGTH) -> int:
    """One length of the mix around ``mean_length``, at most ``cap``."""
    return int(min(cap, max(MIN_LENGTH, rng.lognormal(_mu(mean_length), LENGTH_SIGMA))))


def fill_budget(lengths: Iterable[int], budget: int) -> list[int]:
    """The lengths, in order, while they fit ``budget`` tokens together; ``[budget]`` if the first does not."""
    out, total = [], 0
    for n in lengths:
        if total + n > budget:
            break
        out.append(int(n))
        total += n
    return out or [budget]


def lognormal_lengths(rng: np.random.Generator, budget: int, mean: float = MEAN_LENGTH, cap: int = MAX_LENGTH
                      ) -> list[int]:
    """Document lengths of the mix filling ``budget`` tokens."""
    return fill_budget(iter(lambda: draw_length(rng, mean, cap), None), budget)


# ------------------------------------------------------------------------------------------ batches
def packed_batch(lengths: list[int], vocab: int, seed: int = 0, index: int = 0,
                 prompt_share: float = PROMPT_SHARE) -> PackedBatch:
    """Documents of ``lengths`` tokens packed in one batch: random tokens below ``vocab - 1``, the first
    ``prompt_share`` of each (at least one token, when there is a prompt) not trained."""
    g = torch.Generator().manual_seed(seed)
    doc_lengths = torch.tensor([int(n) for n in lengths], dtype=torch.long)
    num_tokens = int(doc_lengths.sum())
    ids = torch.randint(0, vocab - 1, (num_tokens,), generator=g)
    prompts = (doc_lengths.double() * prompt_share).long()
    if prompt_share > 0:
        prompts = prompts.clamp_min(1)
    starts = torch.cumsum(doc_lengths, 0) - doc_lengths
    positions = torch.arange(num_tokens) - torch.repeat_interleave(starts, doc_lengths)
    mask = positions >= torch.repeat_interleave(prompts, doc_lengths)
    sample_ids = torch.arange(index * 1000, index * 1000 + len(doc_lengths))
    return PackedBatch(ids, mask, doc_lengths, sample_ids, index=index)


def sampled_batches(lengths: np.ndarray, budget: int, vocab: int, count: int, seed: int = 0) -> list[PackedBatch]:
    """``count`` batches of up to ``budget`` tokens, their documents drawn from ``lengths``."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        drawn = (min(int(n), budget) for n in rng.choice(lengths, size=len(lengths)))
        out.append(packed_batch(fill_budget(drawn, budget), vocab, seed=seed + index, index=index))
    return out


def worst_case_batch(num_tokens: int, vocab: int) -> PackedBatch:
    """Preflight's batch of ``num_tokens`` tokens: documents of ``DOC_TOKENS`` (the last one shorter), every
    token trained."""
    lengths = [DOC_TOKENS] * (num_tokens // DOC_TOKENS) + ([num_tokens % DOC_TOKENS] if num_tokens % DOC_TOKENS else [])
    return packed_batch(lengths, vocab, prompt_share=0.0)


# ------------------------------------------------------------------------------------------ FLOPs per sample
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
