"""``prepare``: conversations in, a memory-mapped token dataset out.

The flow, and who waits on whom:

    main process: read raw records (JSONL lines stay unparsed) -> chunks of CHUNK_SIZE
        |  at most 2 x workers chunks in flight (memory stays bounded on any corpus)
        v
    workers: parse JSON, normalize, chat template, verified loss mask, length policy
        |  results come back in submission order, so the output is the same for any --workers
        v
    main process: count skips, reservoir-sample the held-out prompts, append to the flat files

The main process does little per record, so the workers are the bottleneck and the rate scales
with cores. Every record read ends up in exactly one place: the arrays, the held-out set, or a
skip counter (or, with --strict, the first skip stops the run naming file and line).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from draftline.data import readers
from draftline.data.dataset import HELDOUT_FILE, DatasetWriter
from draftline.data.readers import NO_TRAINED_TOKENS, OVERLONG, SKIP_REASONS, PreTokenized, SkipRecord, SourceRecord
from draftline.data.template import ChatEncoder, target_vocab_size
from draftline.errors import DraftlineError

CHUNK_SIZE = 64
NUM_EXAMPLES = 3  # skipped records named per reason in the summary


@dataclass
class PrepareConfig:
    target: Path
    """The target model directory: its tokenizer, chat template and config.json vocab_size."""
    inputs: list[str]
    """Data files (.jsonl[.gz], .json, .parquet) or Hugging Face dataset names (NAME[:SPLIT])."""
    out: Path
    """The dataset directory to write."""
    max_length: int | None = None
    """Longest sample in tokens; None: the target's max_position_embeddings."""
    overlong: str = "truncate"
    """What to do with a longer sample: ``truncate`` (keep the first max_length tokens) or ``drop``."""
    heldout: int = 0
    """Conversations set aside as evaluation prompts (reservoir-sampled, deterministic from seed)."""
    workers: int = 1
    """Tokenizing processes; 1 runs in this process."""
    thinking: bool | None = None
    """``enable_thinking`` for templates that have it; None keeps the template's default."""
    strict: bool = False
    """Stop at the first record that would be skipped, naming its file and line."""
    seed: int = 0
    """Seed of the held-out selection."""
    overwrite: bool = False
    """Replace an existing dataset in ``out``."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self) -> None:
        if self.overlong not in ("truncate", "drop"):
            raise DraftlineError(f"--overlong must be truncate or drop, got {self.overlong!r}")
        if self.max_length is not None and self.max_length < 2:
            raise DraftlineError(f"--max-length must be >= 2, got {self.max_length}")
        if self.heldout < 0 or self.workers < 1:
            raise DraftlineError("--heldout must be >= 0 and --workers >= 1")
        if not self.inputs:
            raise DraftlineError("no --input given")


@dataclass
class _ChunkResult:
    input_ids: np.ndarray  # the chunk's samples end to end
    loss_mask: np.ndarray
    lengths: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # each sample's position in the chunk
    conversational: list[bool] = field(default_factory=list)  # False: pre-tokenized (no prompt to hold out)
    num_truncated: int = 0
    skips: list[tuple[str, str, str]] = field(default_factory=list)  # (reason, where, detail)


class SampleEncoder:
    """Record -> (input_ids, loss_mask) under the length policy; ``SkipRecord`` otherwise."""

    def __init__(self, target: Path, thinking: bool | None, max_length: int | None, overlong: str):
        self.chat = ChatEncoder(target, thinking=thinking)
        self.vocab_size = self.chat.vocab_size
        self.max_length = max_length
        self.overlong = overlong

    def encode(self, record: SourceRecord) -> tuple[np.ndarray, np.ndarray, bool, bool]:
        """``(input_ids, loss_mask, truncated, conversational)``."""
        normalized = readers.normalize(readers.decode(record))
        if isinstance(normalized, PreTokenized):
            ids, mask = normalized.input_ids, normalized.loss_mask
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise DraftlineError(
                    f"{record.where}: token id {int(ids.max())} outside the target's vocabulary ({self.vocab_size}); "
                    "these records were tokenized for another model: tokenize the conversations with this target"
                )
        else:
            ids, mask = self.chat.encode(normalized)
        truncated = False
        if self.max_length is not None and len(ids) > self.max_length:
            if self.overlong == "drop":
                raise SkipRecord(OVERLONG, f"{len(ids)} tokens > --max-length {self.max_length}")
            ids, mask, truncated = ids[: self.max_length], mask[: self.max_length], True
        if not mask.any():
            raise SkipRecord(NO_TRAINED_TOKENS, f"after truncation to {self.max_length} tokens" if truncated else "all-false loss_mask")
        return ids, mask, truncated, not isinstance(normalized, PreTokenized)

    def encode_chunk(self, chunk: list[SourceRecord]) -> _ChunkResult:
        ids_parts, mask_parts = [], []
        result = _ChunkResult(np.zeros(0), np.zeros(0))
        for position, record in enumerate(chunk):
            try:
                ids, mask, truncated, conversational = self.encode(record)
            except SkipRecord as skip:
                result.skips.append((skip.reason, record.where, skip.detail))
                continue
            ids_parts.append(ids)
            mask_parts.append(mask)
            result.lengths.append(len(ids))
            result.positions.append(position)
            result.conversational.append(conversational)
            result.num_truncated += truncated
        result.input_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
        result.loss_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, bool)
        return result


_WORKER: SampleEncoder | None = None


def _init_worker(*args) -> None:
    global _WORKER
    # A worker forked from a process that installed Python signal handlers (an in-process `train`
    # does) inherits them: the SIGTERM of pool.terminate() would then set a flag in a worker blocked
    # on its task queue instead of ending it, and prepare would hang at the end.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER = SampleEncoder(*args)


def _encode_chunk(chunk: list[SourceRecord]) -> _ChunkResult:
    assert _WORKER is not None
    return _WORKER.encode_chunk(chunk)


def _chunks(sources: Iterable[str]) -> Iterator[list[SourceRecord]]:
    chunk: list[SourceRecord] = []
    for source in sources:
        for record in readers.read_source(source):
            chunk.append(record)
            if len(chunk) == CHUNK_SIZE:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _close_pool(pool, in_flight: deque) -> None:
    """Let the chunks still in flight finish (at most 2 x workers), then close the pool normally.

    Not ``Pool.terminate()`` with tasks outstanding: it can wait forever on a worker that holds the
    task queue's lock (seen after a --strict stop in a process that had run training threads).
    """
    deadline = time.monotonic() + 120
    for _chunk, pending in in_flight:
        pending.wait(max(0.0, deadline - time.monotonic()))
    if all(pending.ready() for _chunk, pending in in_flight):
        pool.close()
    else:  # a worker is stuck: nothing else to do
        pool.terminate()
    pool.join()


def _default_max_length(target: Path) -> int | None:
    config = json.loads((target / "config.json").read_text())
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


class _Reservoir:
    """Uniform sample of N conversations from a stream of unknown length (Algorithm R)."""

    def __init__(self, size: int, seed: int):
        self.size = size
        self.rng = random.Random(seed)
        self.seen = 0
        self.items: list[tuple] = []

    def offer(self, item: tuple) -> tuple | None:
        """Keep ``item`` or not; returns whatever leaves the reservoir (the item itself, an evicted one, or None)."""
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        j = self.rng.randrange(self.seen)
        if j < self.size:
            evicted, self.items[j] = self.items[j], item
            return evicted
        return item


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled,
    )


def prepare(config: PrepareConfig) -> dict:
    """Tokenize ``config.inputs`` into ``config.out``; returns the meta written (with statistics)."""
    config.validate()
    target = Path(config.target)
    vocab_size = target_vocab_size(target)
    max_length = config.max_length if config.max_length is not None else _default_max_length(target)
    encoder = SampleEncoder(target, config.thinking, max_length, config.overlong)  # fails fast on a bad target
    for source in config.inputs:
        readers.check_source(source)  # a missing, empty or binary file fails now, not after an hour of the others
    counts = [readers.count_records(s) for s in config.inputs]
    total = sum(counts) if all(c is not None for c in counts) else None

    writer = DatasetWriter(config.out, vocab_size, overwrite=config.overwrite)
    skipped: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}  # the first few skips of each reason, "file:line: detail"
    reservoir = _Reservoir(config.heldout, config.seed)
    num_records = num_truncated = 0
    started = time.perf_counter()
    pool = None
    in_flight: deque = deque()  # (chunk, pending result) submitted to the workers, oldest first
    if config.workers > 1:
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        pool = context.Pool(config.workers, _init_worker, (target, config.thinking, max_length, config.overlong))
    try:
        with _progress(config.progress) as progress:
            task = progress.add_task("prepare", total=total)

            def consume(chunk: list[SourceRecord], result: _ChunkResult) -> None:
                nonlocal num_records, num_truncated
                first_record = num_records
                num_records += len(chunk)
                num_truncated += result.num_truncated
                for reason, where, detail in result.skips:
                    if config.strict:
                        raise DraftlineError(
                            f"{where}: {SKIP_REASONS[reason]} ({reason}{': ' + detail if detail else ''}). "
                            "--strict stops here; fix the record, or drop --strict to skip and count such records"
                        )
                    skipped[reason] += 1
                    if len(examples.setdefault(reason, [])) < NUM_EXAMPLES:
                        examples[reason].append(f"{where}" + (f": {detail}" if detail else ""))
                _write_chunk(writer, reservoir, chunk, result, first_record)
                progress.advance(task, len(chunk))

            if pool is None:
                for chunk in _chunks(config.inputs):
                    consume(chunk, encoder.encode_chunk(chunk))
            else:
                for chunk in _chunks(config.inputs):
                    in_flight.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
                    if len(in_flight) >= 2 * config.workers:
                        chunk_done, pending = in_flight.popleft()
                        consume(chunk_done, pending.get())
                while in_flight:
                    chunk_done, pending = in_flight.popleft()
                    consume(chunk_done, pending.get())
            progress.update(task, total=num_records, completed=num_records)
        if len(writer.lengths) == 0 and reservoir.items:
            raise DraftlineError(f"all {len(reservoir.items)} usable records went to the held-out prompts; lower --heldout")
        if len(writer.lengths) == 0:
            counted = ", ".join(f"{n} {reason} (e.g. {examples[reason][0]})" for reason, n in skipped.most_common())
            raise DraftlineError(
                f"no usable record in {', '.join(map(str, config.inputs))}: all {num_records} were skipped ({counted}); "
                "fix the data (the examples name file and line) and run prepare again"
            )
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            _close_pool(pool, in_flight)

    heldout = _write_heldout(Path(config.out) / HELDOUT_FILE, reservoir, encoder)
    seconds = time.perf_counter() - started
    lengths = writer.lengths
    meta = {
        "target": str(target.resolve()),
        "target_vocab_size": vocab_size,
        "tokenizer": {
            "class": type(encoder.chat.tokenizer).__name__,
            "size": len(encoder.chat.tokenizer),
            "end_of_turn": encoder.chat.end_of_turn,
            "chat_template_sha256": hashlib.sha256(str(encoder.chat.tokenizer.chat_template).encode()).hexdigest(),
            "template_has_thinking": encoder.chat.template_has_thinking,
            "thinking": config.thinking,
        },
        "max_length": max_length,
        "overlong": config.overlong,
        "inputs": [str(s) for s in config.inputs],
        "seed": config.seed,
        "num_records": num_records,
        "num_heldout": heldout,
        "num_truncated": num_truncated,
        "skipped": dict(sorted(skipped.items())),
        "skip_examples": dict(sorted(examples.items())),
        "stats": {
            "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
            "p99_length": float(np.percentile(lengths, 99)) if len(lengths) else 0.0,
            "max_length": int(lengths.max()) if len(lengths) else 0,
            "trained_share": writer.num_trained / max(writer.num_tokens, 1),
            "seconds": round(seconds, 3),
            "samples_per_s": num_records / max(seconds, 1e-9),
            "workers": config.workers,
        },
    }
    writer.finish(meta)
    meta = json.loads((Path(config.out) / "meta.json").read_text())
    assert meta["num_samples"] + heldout + sum(skipped.values()) == num_records, "a record went uncounted"
    return meta


def _write_chunk(writer: DatasetWriter, reservoir: _Reservoir, chunk: list[SourceRecord], result: _ChunkResult,
                 first_record: int) -> None:
    if not result.lengths:
        return
    if reservoir.size == 0:
        writer.add(result.input_ids, result.loss_mask, result.lengths)
        return
    offsets = np.cumsum(result.lengths) - np.asarray(result.lengths)
    for offset, length, position, conversational in zip(offsets, result.lengths, result.positions, result.conversational):
        sample = (result.input_ids[offset : offset + length], result.loss_mask[offset : offset + length], chunk[position],
                  first_record + position)
        leaving = reservoir.offer(sample) if conversational else sample
        if leaving is not None:
            writer.add(leaving[0], leaving[1], [len(leaving[0])])


def _write_heldout(path: Path, reservoir: _Reservoir, encoder: SampleEncoder) -> int:
    """Held-out prompts: the messages before the first assistant turn, and their generation-prompt ids."""
    with open(path, "w", encoding="utf-8") as f:
        for _ids, _mask, record, _order in sorted(reservoir.items, key=lambda item: item[3]):
            messages = readers.prompt_messages(readers.conversation(readers.decode(record)))
            line = {"where": record.where, "messages": messages, "input_ids": encoder.chat.prompt_ids(messages)}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(reservoir.items)


def format_stats(meta: dict) -> list[str]:
    """The statistics prepare prints, as lines."""
    stats = meta["stats"]
    lines = [
        f"records read      {meta['num_records']:,}",
        f"samples           {meta['num_samples']:,}  ({meta['num_truncated']:,} truncated to {meta['max_length']})",
        f"held out          {meta['num_heldout']:,} prompts -> {HELDOUT_FILE}",
        f"tokens            {meta['num_tokens']:,}  (trained {meta['num_trained_tokens']:,} = {100 * stats['trained_share']:.1f}%)",
        f"length            mean {stats['mean_length']:,.0f}, p99 {stats['p99_length']:,.0f}, max {stats['max_length']:,}",
        f"rate              {stats['samples_per_s']:,.0f} records/s with {stats['workers']} worker(s) "
        f"({stats['samples_per_s'] / stats['workers']:,.0f} per core)",
    ]
    skipped = meta["skipped"]
    lines.append(f"skipped           {sum(skipped.values()):,}" + ("" if skipped else " (none)"))
    for reason, count in skipped.items():
        lines.append(f"  {reason:<22}{count:>8,}  {SKIP_REASONS.get(reason, '')}")
        for example in meta.get("skip_examples", {}).get(reason, []):
            lines.append(f"  {'':<22}{'':>8}    e.g. {example}")
    return lines
