"""The prepared dataset on disk, and random access to it.

A dataset directory holds flat arrays so any sample is two slices of a memory map, however large
the corpus:

    tokens.bin     every sample's token ids end to end (uint16 or uint32, see meta)
    loss_mask.bin  one byte per token, 1 on trained (assistant) tokens
    index.npy      int64 [N, 2]: offset and length of sample i in the flat arrays
    meta.json      format version, target vocab size, tokenizer, statistics, skips (written last:
                   a directory without it is an interrupted prepare)
    heldout.jsonl  prompts set aside for evaluation (not in the arrays)

Sample ids are positions in ``index.npy``; batches refer to samples only by these ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from draftline.data.batch import PackedBatch
from draftline.errors import DraftlineError

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
MASK_FILE = "loss_mask.bin"
INDEX_FILE = "index.npy"
META_FILE = "meta.json"
HELDOUT_FILE = "heldout.jsonl"
DATASET_FILES = (TOKENS_FILE, MASK_FILE, INDEX_FILE, META_FILE, HELDOUT_FILE)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class DatasetWriter:
    """Appends samples to the flat files; ``finish`` writes the index and, last, meta.json."""

    def __init__(self, out_dir: str | Path, vocab_size: int, *, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            if not overwrite:
                raise DraftlineError(f"{self.out_dir} exists and is not empty; choose another --out or pass --overwrite")
            unknown = [p.name for p in self.out_dir.iterdir() if p.name not in DATASET_FILES]
            if unknown:
                raise DraftlineError(f"{self.out_dir} holds files that are not a dataset's ({', '.join(unknown[:3])}); refusing to overwrite it")
            for name in DATASET_FILES:
                (self.out_dir / name).unlink(missing_ok=True)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self._tokens = open(self.out_dir / TOKENS_FILE, "wb")
        self._mask = open(self.out_dir / MASK_FILE, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0
        self.num_trained = 0

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray, lengths: list[int] | np.ndarray) -> None:
        """Append one or more samples laid end to end (``lengths`` splits them)."""
        assert len(input_ids) == len(loss_mask) == int(np.sum(lengths))
        self._tokens.write(np.ascontiguousarray(input_ids, dtype=self.dtype).tobytes())
        self._mask.write(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
        self._lengths.extend(int(n) for n in lengths)
        self.num_tokens += len(input_ids)
        self.num_trained += int(np.count_nonzero(loss_mask))

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self._lengths, dtype=np.int64)

    def finish(self, meta: dict) -> None:
        self._tokens.close()
        self._mask.close()
        lengths = self.lengths
        offsets = np.cumsum(lengths) - lengths
        np.save(self.out_dir / INDEX_FILE, np.stack([offsets, lengths], axis=1) if len(lengths) else np.zeros((0, 2), np.int64))
        meta = {"format_version": FORMAT_VERSION, "token_dtype": self.dtype.name, "num_samples": len(lengths),
                "num_tokens": self.num_tokens, "num_trained_tokens": self.num_trained, **meta}
        tmp = self.out_dir / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, self.out_dir / META_FILE)

    def abort(self) -> None:
        """Remove what was written, so a failed prepare leaves nothing to trip over (or to --overwrite)."""
        self._tokens.close()
        self._mask.close()
        for name in DATASET_FILES:
            (self.out_dir / name).unlink(missing_ok=True)
        if not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()


class TokenDataset:
    """A prepared dataset: ``ds[i] -> (input_ids int64, loss_mask bool)``, memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        missing = [name for name in (META_FILE, TOKENS_FILE, MASK_FILE, INDEX_FILE) if not (self.path / name).is_file()]
        if missing:
            hint = "an interrupted prepare" if (self.path / TOKENS_FILE).is_file() else "not a prepared dataset"
            raise DraftlineError(
                f"{self.path}: missing {', '.join(missing)} ({hint}); run `draftline prepare --target TARGET "
                f"--input FILE... --out {self.path} --overwrite`"
            )
        self.meta = json.loads((self.path / META_FILE).read_text())
        version = self.meta.get("format_version")
        if version != FORMAT_VERSION:
            raise DraftlineError(
                f"{self.path}: dataset format version {version}, this draftline reads version {FORMAT_VERSION}; "
                "prepare the data again with this version (draftline prepare ... --overwrite)"
            )
        index = np.load(self.path / INDEX_FILE)
        self.offsets = np.ascontiguousarray(index[:, 0])
        self.lengths = np.ascontiguousarray(index[:, 1])
        num_tokens = int(self.lengths.sum())
        dtype = np.dtype(self.meta["token_dtype"])
        # plain ndarray views of the maps: slicing an np.memmap costs ~5 us of Python per slice
        self._tokens = np.memmap(self.path / TOKENS_FILE, dtype=dtype, mode="r").view(np.ndarray) if num_tokens else np.zeros(0, dtype)
        self._mask = np.memmap(self.path / MASK_FILE, dtype=np.bool_, mode="r").view(np.ndarray) if num_tokens else np.zeros(0, bool)
        end = int((self.offsets + self.lengths).max()) if len(self.lengths) else 0
        if len(self._tokens) < end or len(self._mask) < end:
            raise DraftlineError(f"{self.path}: token files are shorter than the index says (truncated copy?); prepare it again")

    def __len__(self) -> int:
        return len(self.lengths)

    def anchor_positions(self) -> np.ndarray:
        """Per sample, the positions an anchor may take: a trained token followed by a trained one
        (as ``objective.anchors.eligible_anchor_positions`` counts them), int64 [num_samples].
        Read from the loss masks once, then kept."""
        if getattr(self, "_anchor_positions", None) is None:
            mask = self._mask
            self._anchor_positions = np.array(
                [np.count_nonzero(mask[s : s + n - 1] & mask[s + 1 : s + n])
                 for s, n in zip(self.offsets.tolist(), self.lengths.tolist())], dtype=np.int64)
        return self._anchor_positions

    @property
    def vocab_size(self) -> int:
        return int(self.meta["target_vocab_size"])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, length = int(self.offsets[i]), int(self.lengths[i])
        return self._tokens[start : start + length].astype(np.int64), np.array(self._mask[start : start + length])

    def packed_batch(self, sample_indices, epoch: int = 0, index: int = 0) -> PackedBatch:
        """The samples end to end as one ``PackedBatch``; ``index`` is the batch's sequence number."""
        sample_indices = np.asarray(sample_indices, dtype=np.int64)
        lengths = self.lengths[sample_indices]
        spans = [slice(start, start + length) for start, length in zip(self.offsets[sample_indices].tolist(), lengths.tolist())]
        ids = np.concatenate([self._tokens[span] for span in spans], dtype=np.int64)  # one copy, widened on the way
        mask = np.concatenate([self._mask[span] for span in spans])
        return PackedBatch(
            input_ids=torch.from_numpy(ids),
            loss_mask=torch.from_numpy(mask),
            doc_lengths=torch.from_numpy(lengths),
            sample_ids=torch.from_numpy(sample_indices.copy()),
            epoch=int(epoch),
            index=int(index),
        )

    def heldout(self) -> list[dict]:
        """The held-out prompts (``messages`` and ``input_ids``) written by prepare."""
        path = self.path / HELDOUT_FILE
        if not path.is_file():
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
