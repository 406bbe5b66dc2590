"""Reading conversation records from JSONL, JSON, Parquet or a Hugging Face dataset.

Reading and parsing are split on purpose: ``read_sources`` only yields raw payloads (a JSONL line
is passed on unparsed), so the main process of ``prepare`` stays a cheap reader and the JSON
parsing runs in the tokenizing workers. Every payload carries where it came from, because every
error and every ``--strict`` skip has to name the file and line.

``normalize`` turns any supported record shape into one of two things: a list of
``{"role", "content"}`` messages (OpenAI and ShareGPT) or a ``PreTokenized`` record.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from draftline.errors import DraftlineError

# Why a record was skipped; prepare and regenerate count records under these names.
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_CONTENT = "empty_content"
UNKNOWN_ROLE = "unknown_role"
MASK_MISMATCH = "template_mask_mismatch"
TEMPLATE_ERROR = "template_error"
OVERLONG = "overlong"
NO_TRAINED_TOKENS = "no_trained_tokens"
UNRECOGNISED_RECORD = "unrecognised_record"
NO_USER_TURN = "no_user_turn"
MALFORMED_JSON = "malformed_json"
BAD_BYTES = "bad_bytes"
WRONG_TYPE = "wrong_type"

SKIP_REASONS = {
    NO_ASSISTANT_TURN: "no assistant turn",
    EMPTY_CONTENT: "a user or assistant turn with empty content",
    UNKNOWN_ROLE: "a role other than system/user/assistant",
    MASK_MISMATCH: "the chat template moved or dropped an assistant turn (mask not verifiable)",
    TEMPLATE_ERROR: "the chat template refused the conversation",
    OVERLONG: "longer than --max-length (with --overlong drop)",
    NO_TRAINED_TOKENS: "no assistant token left (after truncation, or an all-false loss_mask)",
    UNRECOGNISED_RECORD: "neither messages, conversations nor input_ids + loss_mask",
    NO_USER_TURN: "nothing to reply to (regenerate)",
    MALFORMED_JSON: "malformed JSON (a file cut mid-line ends in one)",
    BAD_BYTES: "bytes that are not UTF-8 text",
    WRONG_TYPE: "a field of the wrong type (a record that is not an object, content or input_ids not text/integers)",
}

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class SkipRecord(Exception):
    """A record that cannot become a training sample; counted by ``reason`` (or an error with --strict)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class SourceRecord:
    where: str  # "file:line" or "file record N": what an error message points at
    index: int  # 0-based position among the source's records: the record's stable id
    payload: Any  # a raw JSONL line (str) or an already decoded record (dict)


@dataclass
class PreTokenized:
    input_ids: np.ndarray  # int64
    loss_mask: np.ndarray  # bool


def _is_hf_name(source: str) -> bool:
    return not Path(source).suffix and source.count("/") <= 1 and not source.startswith((".", "/"))


_SNIFF_BYTES = 1 << 16
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some Windows tools write
_MAGIC = {b"PAR1": "a Parquet file", b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive", b"\x89PNG": "a PNG image",
          b"%PDF": "a PDF", b"\x7fELF": "a program (ELF)", b"\x93NUMPY": "a NumPy array"}


def _what_binary(head: bytes) -> str | None:
    """What a file that should be text looks like instead, or None if it looks like text."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16 text"
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"binary (a NUL byte at offset {nul})"
    return None


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _head(path: Path) -> bytes:
    """The first bytes of the file's content (uncompressed for .gz, without a UTF-8 BOM); errors name the file."""
    try:
        with _open_binary(path) as f:
            return f.read(_SNIFF_BYTES).removeprefix(_BOM)
    except PermissionError as exc:
        raise DraftlineError(f"{path}: cannot be read ({exc.strerror}); check its permissions") from None
    except (gzip.BadGzipFile, EOFError, OSError) as exc:
        raise DraftlineError(f"{path}: the gzip stream is cut or corrupt ({exc}); re-compress it, or name it .jsonl if it is plain text") from None


def check_source(source: str | Path, default_kind: str | None = None) -> str:
    """``source_kind``, plus a look at the file's first bytes: a file that is empty, binary or of
    another format than its name says fails here, naming the file and the fix, before any record is read."""
    kind = source_kind(source, default_kind)
    if kind == "hf":
        return kind
    path = Path(source)
    if path.stat().st_size == 0:
        raise DraftlineError(f"{path}: empty file (0 bytes, no records); remove it from the inputs or re-export the data")
    if kind == "parquet":
        if _parquet_file(path).metadata.num_rows == 0:
            raise DraftlineError(f"{path}: a Parquet file with 0 rows; remove it from the inputs or re-export the data")
        return kind
    head = _head(path)
    what = _what_binary(head)
    if what:
        hint = {"a Parquet file": "rename it to .parquet", "gzip-compressed": "name it .jsonl.gz",
                "UTF-16 text": "re-save it as UTF-8"}.get(what, "pass the JSONL, JSON or Parquet data itself")
        raise DraftlineError(f"{path}: not a text {kind.upper()} file: it is {what}; {hint}")
    if not head.strip():
        raise DraftlineError(f"{path}: holds only whitespace (no records); remove it from the inputs or re-export the data")
    first = head.lstrip()[:1]
    if kind == "jsonl" and first == b"[":
        raise DraftlineError(f"{path}: starts with '[', a JSON array, not one object per line; name it .json (or write one record per line)")
    if first not in (b"{", b"["):
        raise DraftlineError(f"{path}: does not start with a JSON object or list (starts with {head.lstrip()[:20]!r}); "
                             f"is it really {kind.upper()}? Pass JSONL (one object per line), JSON or Parquet")
    return kind


def _read_jsonl(path: Path) -> Iterator[SourceRecord]:
    # Bytes, not text: a line with bad bytes is a counted skip (decode says which), not a crash of the reader.
    index = 0
    try:
        with _open_binary(path) as f:
            for line_no, line in enumerate(f, 1):
                if line_no == 1:
                    line = line.removeprefix(_BOM)
                if line.strip():
                    yield SourceRecord(f"{path}:{line_no}", index, line)
                    index += 1
    except (gzip.BadGzipFile, EOFError) as exc:
        raise DraftlineError(f"{path}: the gzip stream is cut or corrupt after {index} records ({exc}); "
                             "re-compress the file (or drop it from the inputs)") from None
    if index == 0:
        raise DraftlineError(f"{path}: no records (only blank lines); remove it from the inputs or re-export the data")


def _read_json(path: Path) -> Iterator[SourceRecord]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DraftlineError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); re-save it as UTF-8, "
                             "or as JSONL so that a bad record is skipped instead of the whole file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line under a .json name
            yield from _read_jsonl(path)
            return
        at_end = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        cut = " (the file ends inside it: it looks truncated)" if at_end else ""
        raise DraftlineError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg}){cut}; the whole file is one JSON document, "
                             "so nothing of it can be read: fix or re-export it, or convert it to JSONL") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DraftlineError(f"{path}: expected a JSON list of records (or one record object), got {type(data).__name__}")
    if not data:
        raise DraftlineError(f"{path}: an empty JSON list (no records); remove it from the inputs or re-export the data")
    for i, record in enumerate(data):
        yield SourceRecord(f"{path} record {i}", i, record)


def _parquet_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        with open(path, "rb") as f:
            head = f.read(4)
        hint = ("it is not Parquet (no PAR1 header): is it JSONL or JSON under a .parquet name? Rename it"
                if head != b"PAR1" else "it is truncated or corrupt (the footer is missing or damaged): copy or re-export it")
        raise DraftlineError(f"{path}: not a readable Parquet file; {hint} ({str(exc)[:120]})") from None


def _read_parquet(path: Path) -> Iterator[SourceRecord]:
    import pyarrow as pa

    parquet = _parquet_file(path)
    if parquet.metadata.num_rows == 0:
        raise DraftlineError(f"{path}: a Parquet file with 0 rows; remove it from the inputs or re-export the data")
    index = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield SourceRecord(f"{path} row {index}", index, record)
                index += 1
    except (pa.ArrowException, OSError) as exc:
        raise DraftlineError(f"{path}: unreadable after row {index} (a damaged data page: {str(exc)[:120]}); "
                             "copy or re-export the file") from None


def _read_hf(source: str) -> Iterator[SourceRecord]:
    name, _, split = source.partition(":")
    try:
        import datasets
    except ImportError:
        raise DraftlineError(
            f"{source!r} is not a file; reading a Hugging Face dataset by name needs the `datasets` package "
            "(pip install datasets) and a reachable hub. Or download it and pass the JSONL/Parquet files."
        ) from None
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:  # the hub, the network or the name: the cause is in the message
        raise DraftlineError(f"could not load Hugging Face dataset {name!r} (split {split or 'train'!r}): {exc}") from None
    for i, record in enumerate(ds):
        yield SourceRecord(f"{source} row {i}", i, record)


def source_kind(source: str | Path, default_kind: str | None = None) -> str:
    """``jsonl``, ``json``, ``parquet`` or ``hf``; an error for anything else, before any reading."""
    path = Path(source)
    if path.is_file():
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
            return "jsonl"
        if name.endswith(".json"):
            return "json"
        if name.endswith(".parquet"):
            return "parquet"
        if default_kind:
            return default_kind
        raise DraftlineError(f"{path}: unknown file type; use .jsonl, .jsonl.gz, .json or .parquet")
    if path.exists():
        raise DraftlineError(f"{path} is a directory; pass the data files themselves (e.g. {path}/*.jsonl)")
    if _is_hf_name(str(source)):
        return "hf"
    raise DraftlineError(f"{source}: no such file")


def read_source(source: str | Path, *, default_kind: str | None = None) -> Iterator[SourceRecord]:
    """Raw records of one input: a .jsonl[.gz] / .json / .parquet file, or ``NAME[:SPLIT]`` on the HF hub
    (``default_kind``: how to read a file of another extension; else such a file is an error)."""
    kind = check_source(source, default_kind)
    if kind == "hf":
        return _read_hf(str(source))
    return {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}[kind](Path(source))


def count_records(source: str | Path) -> int | None:
    """Roughly how many records a source holds, cheaply (for the progress bar); None if unknown."""
    path = Path(source)
    if not path.is_file():
        return None
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _parquet_file(path).metadata.num_rows
    if name.endswith((".jsonl", ".ndjson", ".json")):
        count = 0
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                count += block.count(b"\n")
        return max(count, 1)
    return None


def decode(record: SourceRecord) -> dict:
    """The record as a dict; bad bytes, malformed JSON or a non-object raise ``SkipRecord`` (counted,
    or with --strict an error naming the file and line)."""
    payload = record.payload
    if isinstance(payload, bytes):
        try:
            payload = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SkipRecord(BAD_BYTES, f"invalid UTF-8 at byte {exc.start} of the line ({payload[exc.start:exc.start + 4]!r}); "
                                        "re-encode the file as UTF-8") from None
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            unterminated = not payload.endswith("\n")  # only the last line of a file can end so
            cut = "; the last line ends without a newline: the file looks truncated" if unterminated else ""
            raise SkipRecord(MALFORMED_JSON, f"{exc.msg} at column {exc.colno}{cut}") from None
    if not isinstance(payload, dict):
        raise SkipRecord(WRONG_TYPE, f"a JSON {type(payload).__name__}, not an object")
    return payload


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text can be trained on
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise SkipRecord(UNRECOGNISED_RECORD, f"non-text content part {str(part)[:60]!r}")
        return "".join(parts)
    raise SkipRecord(WRONG_TYPE, f"content of type {type(content).__name__}")


def _messages(turns: list, role_key: str, content_key: str, empty_replies_ok: bool) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SkipRecord(WRONG_TYPE, f"turn {i} is a {type(turn).__name__}, not an object")
        if not isinstance(turn.get(role_key, ""), str):
            raise SkipRecord(WRONG_TYPE, f"turn {i}: {role_key} is a {type(turn.get(role_key)).__name__}, not a string")
        raw_role = str(turn.get(role_key, "")).strip().lower()
        role = _ROLES.get(raw_role)
        if role is None:
            raise SkipRecord(UNKNOWN_ROLE, f"turn {i} has role {turn.get(role_key)!r}")
        content = _text(turn.get(content_key))
        if not content.strip():
            if role == "system":
                continue  # an empty system prompt says nothing; dropping it changes no trained token
            if not (role == "assistant" and empty_replies_ok):  # else a placeholder regenerate fills
                raise SkipRecord(EMPTY_CONTENT, f"turn {i} ({role}) is empty")
            content = ""
        message = {"role": role, "content": content}
        reasoning = turn.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _turns(record: dict, empty_replies_ok: bool) -> list[dict]:
    if isinstance(record.get("messages"), list):
        return _messages(record["messages"], "role", "content", empty_replies_ok)
    for key in ("messages", "conversations"):
        if key in record and not isinstance(record[key], list):
            raise SkipRecord(WRONG_TYPE, f"{key} is a {type(record[key]).__name__}, not a list of turns")
    if isinstance(record.get("conversations"), list):
        turns = record["conversations"]
        keys = ("role", "content") if turns and isinstance(turns[0], dict) and "role" in turns[0] else ("from", "value")
        return _messages(turns, *keys, empty_replies_ok)
    raise SkipRecord(UNRECOGNISED_RECORD, f"keys {sorted(record)[:8]}")


def conversation(record: dict) -> list[dict]:
    """OpenAI ``messages`` or ShareGPT ``conversations`` as ``[{"role", "content"}, ...]``.

    Turns after the last assistant turn are cut: they would cost tokens and train nothing.
    """
    messages = _turns(record, empty_replies_ok=False)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise SkipRecord(NO_ASSISTANT_TURN)
    return messages[: last + 1]


def conversation_to_regenerate(record: dict) -> list[dict]:
    """Like ``conversation``, for regenerate: assistant turns may be empty placeholders, and a
    conversation that ends with a user turn (a prompt-only record too) gets a reply slot at the end."""
    messages = _turns(record, empty_replies_ok=True)
    if not any(m["role"] == "user" for m in messages):
        raise SkipRecord(NO_USER_TURN)
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    return messages


def _int_list(value: Any, name: str) -> np.ndarray:
    """A list of integers (bools allowed in a mask) as int64; ``SkipRecord`` for anything else."""
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or (array.size and array.dtype.kind not in "iub"):
        raise SkipRecord(WRONG_TYPE, f"{name} must be a list of integers, got {str(value)[:40]!r}")
    return array.astype(np.int64)


def normalize(record: dict) -> list[dict] | PreTokenized:
    """A conversation, or a pre-tokenized record; raises ``SkipRecord`` for anything else."""
    if "input_ids" in record and "messages" not in record and "conversations" not in record:
        if "loss_mask" not in record:
            raise SkipRecord(UNRECOGNISED_RECORD, "input_ids without loss_mask")
        ids, mask = _int_list(record["input_ids"], "input_ids"), _int_list(record["loss_mask"], "loss_mask")
        if ids.ndim != 1 or mask.shape != ids.shape or ids.size == 0:
            raise SkipRecord(UNRECOGNISED_RECORD, f"input_ids ({ids.size}) and loss_mask ({mask.size}) must be equal-length lists")
        return PreTokenized(ids, mask.astype(bool))
    return conversation(record)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) its first assistant turn: a prompt for evaluation."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first]
