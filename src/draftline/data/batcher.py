"""Token-budget batching, and the whole run as one numbered sequence of batches.

A batch is whole documents packed end to end up to ``token_budget`` tokens (attention never crosses
a document, so packing costs nothing but the unfilled tail). Each epoch:

    shuffle all samples  ->  sort by length inside windows of ``sort_window`` samples
    ->  cut greedily into batches (<= token_budget tokens, <= max_batch_size documents)
    ->  shuffle the batch order

Windows keep the shuffle's randomness while neighbours have similar lengths, so a batch's tail
waste stays small; shuffling the batch order undoes the length ordering across the epoch.

When an optimizer step takes several batches (``step_batches``: several drafters, or gradient
accumulation), the batches of one step are chosen with similar drafter work: the shuffled batches
are sorted by their anchor count (per document min(max_anchors, the positions its loss mask allows):
the drafter's rows), cut into
groups of ``step_batches`` that line up with the run's steps, and the groups are shuffled. Drafters
meet at every step's all-reduce, so a step lasts as long as its slowest drafter's share: a batch of
32 short documents has ~6x the anchors of a batch of 5 long ones. With ``step_batches == 1`` the
order is the plain shuffle.
Everything is a pure function of ``(seed, epoch)``, which makes resume exact: ``BatchSchedule``
numbers the batches of all epochs 0..total-1, and "resume" is "continue from sequence number s".
Several consumers take disjoint shares (consumer t of T takes s = t, t + T, ...) of the same
sequence, so their union is the uninterrupted run whatever T is.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from draftline.errors import DraftlineError


class TokenBudgetBatcher:
    """Per-epoch batches of sample indices; deterministic from ``(seed, epoch)``."""

    def __init__(self, lengths, token_budget: int, max_batch_size: int, seed: int = 0, sort_window: int = 1024,
                 cache_epochs: int = 2, step_batches: int = 1, max_anchors: int = 512,
                 anchor_positions=None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise DraftlineError("the dataset has no samples; check the prepare statistics (everything skipped?)")
        if min(token_budget, max_batch_size, sort_window, step_batches, max_anchors) < 1:
            raise DraftlineError(f"token_budget ({token_budget}), max_batch_size ({max_batch_size}), sort_window "
                                 f"({sort_window}), step_batches ({step_batches}) and max_anchors ({max_anchors}) must be >= 1")
        too_long = np.flatnonzero(self.lengths > token_budget)
        if len(too_long):
            first = int(too_long[0])
            raise DraftlineError(
                f"{len(too_long)} samples are longer than the token budget {token_budget} (sample {first} has "
                f"{int(self.lengths[first])} tokens, the longest {int(self.lengths.max())}); raise --token-budget or "
                f"prepare the data again with --max-length {token_budget}"
            )
        self.token_budget = int(token_budget)
        self.max_batch_size = int(max_batch_size)
        self.seed = int(seed)
        self.sort_window = int(sort_window)
        self.step_batches = int(step_batches)
        self.max_anchors = int(max_anchors)
        # A sample's drafter work: its anchors, min(max_anchors, the positions an anchor may take; without
        # them, its length). The dataset's loss masks give the positions (TokenDataset.anchor_positions).
        positions = self.lengths if anchor_positions is None else np.asarray(anchor_positions, dtype=np.int64)
        if positions.shape != self.lengths.shape:
            raise DraftlineError(f"anchor_positions has {positions.shape[0]} entries for {len(self.lengths)} samples")
        self._anchors = np.minimum(positions, self.max_anchors)
        self._cache: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._cache_epochs = max(1, cache_epochs)
        self._counts: dict[int, int] = {}  # batches per epoch (the order does not change it)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of ``epoch`` in training order, each an int64 array of sample indices."""
        if epoch in self._cache:
            self._cache.move_to_end(epoch)
            return self._cache[epoch]
        batches = self._build(epoch)
        self._cache[epoch] = batches
        while len(self._cache) > self._cache_epochs:
            self._cache.popitem(last=False)
        return batches

    def _cut(self, epoch: int) -> tuple[np.random.Generator, list[np.ndarray]]:
        """The epoch's batches in length order, and the epoch's generator (drawn from once so far)."""
        rng = np.random.default_rng([self.seed, int(epoch)])
        n = self.num_samples
        order = rng.permutation(n)
        lengths = self.lengths[order]
        # sort inside windows: one stable argsort on (window, length) packed into one int64 key
        key = (np.arange(n, dtype=np.int64) // self.sort_window << 32) | lengths
        by_key = np.argsort(key, kind="stable")
        order, lengths = order[by_key], lengths[by_key]

        # Greedy cut. For every position at once: the furthest end a batch starting there may reach
        # (budget and size); then follow that chain from 0, a Python step per BATCH, not per sample.
        cumsum = np.concatenate([[0], np.cumsum(lengths)])
        reach = np.searchsorted(cumsum, cumsum[:-1] + self.token_budget, side="right") - 1
        reach = np.minimum(reach, np.arange(1, n + 1) + (self.max_batch_size - 1)).tolist()
        cuts = [0]
        while cuts[-1] < n:
            cuts.append(reach[cuts[-1]])
        batches = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        self._counts[epoch] = len(batches)
        return rng, batches

    def _build(self, epoch: int) -> list[np.ndarray]:
        rng, batches = self._cut(epoch)
        shuffled = [batches[i] for i in rng.permutation(len(batches)).tolist()]
        if self.step_batches == 1:
            return shuffled
        return self._balanced(rng, shuffled, self._epoch_offset(epoch) % self.step_batches)

    def anchors(self, batch: np.ndarray) -> int:
        """The drafter's work in ``batch``, in anchors: each document gives up to ``max_anchors``."""
        return int(self._anchors[batch].sum())

    def _balanced(self, rng: np.random.Generator, shuffled: list[np.ndarray], phase: int) -> list[np.ndarray]:
        """``shuffled`` reordered so that each step's ``step_batches`` batches have similar anchor counts.

        The epoch starts ``phase`` batches into a step: its first ``step_batches - phase`` batches
        finish that step, and its last (partial) group starts the next epoch's first step. Those
        spare batches are a run of neighbours in work order taken at a random place (so no kind of
        batch always opens or closes an epoch); the full groups between are shuffled.
        """
        k = self.step_batches
        by_work = sorted(range(len(shuffled)), key=lambda i: self.anchors(shuffled[i]))  # stable: ties keep the shuffle
        head = min((k - phase) % k, len(by_work))
        spare = head + (len(by_work) - head) % k
        full = len(by_work) - spare
        at = int(rng.integers(0, full // k + 1)) * k
        spares, rest = by_work[at : at + spare], by_work[:at] + by_work[at + spare :]
        groups = [rest[i : i + k] for i in range(0, full, k)]
        ordered = spares[:head] + [i for g in rng.permutation(len(groups)).tolist() for i in groups[g]] + spares[head:]
        return [shuffled[i] for i in ordered]

    def _epoch_offset(self, epoch: int) -> int:
        """Batches in the epochs before ``epoch`` (where it starts in the run's sequence)."""
        for e in range(epoch):
            if e not in self._counts:
                self._cut(e)
        return sum(self._counts[e] for e in range(epoch))

    def num_batches(self, epoch: int) -> int:
        """Batches in ``epoch`` (cut once; the order is not needed to count them)."""
        if epoch not in self._counts:
            self._cut(epoch)
        return self._counts[epoch]

    def packing_efficiency(self, epoch: int = 0) -> float:
        """Tokens / (batches * token_budget): 1.0 means no batch leaves room unused."""
        return float(self.lengths.sum()) / (self.num_batches(epoch) * self.token_budget)


@dataclass(frozen=True)
class ScheduledBatch:
    seq: int  # sequence number in the whole run: what resume and PackedBatch.index refer to
    epoch: int
    index_in_epoch: int
    sample_indices: np.ndarray


class BatchSchedule:
    """All epochs' batches as one sequence ``0 .. total_batches - 1``."""

    def __init__(self, batcher: TokenBudgetBatcher, num_epochs: int):
        if num_epochs < 1:
            raise DraftlineError(f"num_epochs must be >= 1, got {num_epochs}")
        self.batcher = batcher
        self.num_epochs = int(num_epochs)
        self._epoch_starts: list[int] = [0]  # grows lazily: start seq of epochs 0..k

    def _starts_through(self, epoch: int) -> None:
        while len(self._epoch_starts) <= epoch + 1:
            e = len(self._epoch_starts) - 1
            self._epoch_starts.append(self._epoch_starts[-1] + self.batcher.num_batches(e))

    @property
    def total_batches(self) -> int:
        """Needs every epoch's batch count: the first call builds (and forgets) each epoch once."""
        self._starts_through(self.num_epochs - 1)
        return self._epoch_starts[self.num_epochs]

    def steps(self, batches_per_step: int, max_steps: int | None = None) -> int:
        """Optimizer steps of ``batches_per_step`` batches: every batch once (the last step may be short),
        or ``max_steps``."""
        steps = math.ceil(self.total_batches / batches_per_step)
        return min(steps, max_steps) if max_steps else steps

    def epoch_start(self, epoch: int) -> int:
        self._starts_through(epoch)
        return self._epoch_starts[epoch]

    def locate(self, seq: int) -> tuple[int, int]:
        """``(epoch, index_in_epoch)`` of batch ``seq``; builds epochs only up to the one it is in."""
        if seq < 0:
            raise IndexError(f"batch sequence number {seq} < 0")
        while self._epoch_starts[-1] <= seq and len(self._epoch_starts) <= self.num_epochs:
            self._starts_through(len(self._epoch_starts) - 1)
        if seq >= self._epoch_starts[-1]:
            raise IndexError(f"batch sequence number {seq} is past the end of the run ({self._epoch_starts[-1]} batches)")
        epoch = bisect.bisect_right(self._epoch_starts, seq) - 1
        return epoch, seq - self._epoch_starts[epoch]

    def sample_indices(self, seq: int) -> np.ndarray:
        epoch, index = self.locate(seq)
        return self.batcher.epoch_batches(epoch)[index]

    def batches(self, start: int = 0, consumer: int = 0, num_consumers: int = 1) -> Iterator[ScheduledBatch]:
        """Batches ``seq >= start`` with ``seq % num_consumers == consumer``, in order, to the end of the run."""
        if not 0 <= consumer < num_consumers:
            raise DraftlineError(f"consumer {consumer} is not one of 0..{num_consumers - 1}")
        if start < 0:
            raise DraftlineError(f"start sequence number {start} < 0")
        seq = start + (consumer - start) % num_consumers
        while True:
            try:
                epoch, index = self.locate(seq)
            except IndexError:
                return
            yield ScheduledBatch(seq, epoch, index, self.batcher.epoch_batches(epoch)[index])
            seq += num_consumers
