"""``regenerate``: replace every assistant turn with what the target itself says.

Turn by turn: turn i is generated from the conversation with turns before it already replaced,
so each reply answers the history the target would really have produced. Records are processed in
groups; inside a group all records' turn 1 go to the generator together, then all turn 2, ...

Resumable by construction. Each output line carries the input record's index (``source_index``);
a group's lines are appended and flushed when the group is done. On start the output is read
back: finished indices are skipped, and a last line cut short by a kill is trimmed away (its record
is redone). A conversation that ends with a user turn (a prompt-only record too) gets a reply
appended. Records that cannot be regenerated go, with the reason, to ``OUT.failed.jsonl``, which
each run rewrites since it retries them; nothing is dropped without a line in one of the two files.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from draftline.data import readers
from draftline.data.generate import Reply
from draftline.data.readers import SkipRecord, SourceRecord
from draftline.errors import DraftlineError


class Generator(Protocol):
    def complete(self, conversations: list[list[dict]]) -> list[Reply]: ...


def failed_path(out: Path) -> Path:
    return out.with_name(out.stem + ".failed.jsonl") if out.suffix else out.with_name(out.name + ".failed.jsonl")


def load_done(out: Path) -> set[int]:
    """Source indices already in ``out``; trims a last line cut short by an interruption."""
    if not out.exists():
        return set()
    done: set[int] = set()
    good_end = 0
    with open(out, "rb") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        is_last = number == len(lines)
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            index = int(json.loads(line)["source_index"])
        except (ValueError, KeyError, TypeError):
            if is_last:
                break  # a write cut short: trim it, the record is redone
            raise DraftlineError(f"{out}:{number}: not a regenerate output line; pass another --out or remove the line") from None
        done.add(index)
        good_end += len(line)
    if good_end < out.stat().st_size:
        with open(out, "r+b") as f:
            f.truncate(good_end)
    return done


@dataclass
class _Pending:
    record: SourceRecord
    messages: list[dict] = field(default_factory=list)
    error: str | None = None
    kind: str = ""  # what kind of failure: a skip reason, malformed_record or generation_failed
    finish_reasons: list[str] = field(default_factory=list)
    source_id: object = None


def _start(record: SourceRecord) -> _Pending:
    pending = _Pending(record)
    try:
        data = readers.decode(record)
        pending.source_id = data.get("id")
        if "input_ids" in data and "messages" not in data and "conversations" not in data:
            raise SkipRecord("pre_tokenized", "a tokenized record has no text to regenerate")
        pending.messages = readers.conversation_to_regenerate(data)
    except SkipRecord as skip:
        pending.error, pending.kind = str(skip), skip.reason
    except DraftlineError as exc:  # a malformed line: recorded as a failure, the run goes on
        pending.error, pending.kind = str(exc), "malformed_record"
    return pending


def _regenerate_group(group: list[_Pending], generator: Generator) -> None:
    turn = 0
    while True:
        asks = []  # (pending, position of its turn-th assistant message)
        for pending in group:
            if pending.error is None:
                positions = [i for i, m in enumerate(pending.messages) if m["role"] == "assistant"]
                if turn < len(positions):
                    asks.append((pending, positions[turn]))
        if not asks:
            return
        replies = generator.complete([pending.messages[:pos] for pending, pos in asks])
        for (pending, pos), reply in zip(asks, replies, strict=True):
            if reply.error is not None:
                pending.error, pending.kind = f"assistant turn {turn + 1}: {reply.error}", "generation_failed"
                continue
            message = {"role": "assistant", "content": reply.content}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            pending.messages[pos] = message
            pending.finish_reasons.append(reply.finish_reason)
        turn += 1


def _groups(records: Iterator[SourceRecord], done: set[int], limit: int | None, size: int) -> Iterator[list[SourceRecord]]:
    group: list[SourceRecord] = []
    for record in records:
        if limit is not None and record.index >= limit:
            break
        if record.index in done:
            continue
        group.append(record)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def regenerate(input_path: str | Path, out: str | Path, generator: Generator, *, group_size: int = 8,
               limit: int | None = None, progress: bool = True, max_seconds: float | None = None) -> dict:
    """Regenerate ``input_path`` into ``out`` (resuming what is there); returns the run's statistics.

    ``max_seconds``: no group starts after that many seconds (``stats["time_up"]``); what is written is
    kept, and the same call later continues it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    out = Path(out)
    readers.check_source(input_path)
    if Path(input_path).resolve() == out.resolve():
        raise DraftlineError(f"--out {out} is the input file; write the regenerated data to a new file")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = load_done(out)
    total = readers.count_records(input_path)
    if total is not None and limit is not None:
        total = min(total, limit)
    stats = {"already_done": len(done), "regenerated": 0, "failed": 0, "cut_by_max_new_tokens": 0, "time_up": False}
    reasons: Counter[str] = Counter()
    started = time.perf_counter()
    columns = (TextColumn("[bold]regenerate"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with open(out, "a", encoding="utf-8") as out_file, open(failed_path(out), "w", encoding="utf-8") as failed_file, \
            Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("regenerate", total=total, completed=min(len(done), total or len(done)))
        for group in _groups(readers.read_source(input_path), done, limit, group_size):
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                stats["time_up"] = True
                break
            pendings = [_start(record) for record in group]
            _regenerate_group(pendings, generator)
            for pending in pendings:
                if pending.error is None:
                    line = {"source_index": pending.record.index, "messages": pending.messages, "finish_reasons": pending.finish_reasons}
                    if pending.source_id is not None:
                        line["id"] = pending.source_id
                    out_file.write(json.dumps(line, ensure_ascii=False) + "\n")
                    stats["regenerated"] += 1
                    stats["cut_by_max_new_tokens"] += pending.finish_reasons.count("length")
                else:
                    failed_file.write(json.dumps({"source_index": pending.record.index, "where": pending.record.where,
                                                  "kind": pending.kind, "reason": pending.error}, ensure_ascii=False) + "\n")
                    stats["failed"] += 1
                    reasons[pending.kind] += 1
            out_file.flush()  # a group is on disk before the next starts: resume loses at most one group
            failed_file.flush()
            bar.advance(task, len(group))
    stats["failure_kinds"] = dict(reasons)
    stats["seconds"] = round(time.perf_counter() - started, 3)
    stats["failed_file"] = str(failed_path(out))
    return stats
