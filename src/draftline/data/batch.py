"""A packed batch: whole documents laid end to end in one flat row, no padding.

This is what the batcher yields, what a target turns into features and what the drafter's
objective reads. Attention never crosses a document boundary, so packing costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64, the documents one after another
    loss_mask: torch.Tensor  # [T] bool, True on trainable (assistant) tokens
    doc_lengths: torch.Tensor  # [D] int64, sum == T
    sample_ids: torch.Tensor  # [D] int64, each document's stable id in its dataset
    epoch: int = 0
    index: int = 0  # the batch's sequence number in the whole run

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_lengths.shape[0])

    def doc_starts(self) -> torch.Tensor:
        """Offset of each document's first token, [D]."""
        return torch.cumsum(self.doc_lengths, 0) - self.doc_lengths

    def doc_ids(self) -> torch.Tensor:
        """Document index (0..D-1) of each token, [T]."""
        return torch.repeat_interleave(torch.arange(self.num_docs, device=self.doc_lengths.device), self.doc_lengths)

    def positions(self) -> torch.Tensor:
        """Position of each token inside its document (restarts at 0), [T]."""
        starts = torch.repeat_interleave(self.doc_starts(), self.doc_lengths)
        return torch.arange(self.num_tokens, device=self.input_ids.device) - starts

    @classmethod
    def from_documents(
        cls,
        docs: list[tuple[list[int], list[bool]]],
        sample_ids: list[int] | None = None,
        epoch: int = 0,
        index: int = 0,
    ) -> "PackedBatch":
        """Pack ``[(input_ids, loss_mask), ...]``; sample ids default to 0..D-1."""
        if not docs:
            raise ValueError("a batch needs at least one document")
        ids = torch.tensor([t for d, _ in docs for t in d], dtype=torch.long)
        mask = torch.tensor([bool(m) for _, ms in docs for m in ms], dtype=torch.bool)
        lengths = torch.tensor([len(d) for d, _ in docs], dtype=torch.long)
        if any(len(d) != len(m) for d, m in docs):
            raise ValueError("each document needs one loss-mask entry per token")
        sids = torch.tensor(sample_ids if sample_ids is not None else list(range(len(docs))), dtype=torch.long)
        return cls(ids, mask, lengths, sids, epoch, index)

    def slice_docs(self, first: int, last: int) -> "PackedBatch":
        """Documents ``first .. last - 1`` as a batch of their own (same epoch and index)."""
        starts = self.doc_starts()
        lo = int(starts[first]) if first < self.num_docs else self.num_tokens
        hi = int(starts[last]) if last < self.num_docs else self.num_tokens
        return PackedBatch(
            self.input_ids[lo:hi],
            self.loss_mask[lo:hi],
            self.doc_lengths[first:last],
            self.sample_ids[first:last],
            self.epoch,
            self.index,
        )
