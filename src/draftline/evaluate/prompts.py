"""Evaluation prompts from JSONL: token ids, or a conversation rendered with the chat template.

One JSON object per line (blank lines are skipped):

- ``input_ids``: the prompt's token ids, used as they are (``prepare``'s ``heldout.jsonl`` has
  them next to the messages, so it needs no tokenizer);
- else ``messages`` (OpenAI) or ``conversations`` (ShareGPT): the turns before the first assistant
  turn, rendered with the target's chat template and its generation prompt.

Every error names the file and line. The file is read by ``draftline.data.readers``.
"""

from __future__ import annotations

from pathlib import Path

from draftline.data import readers
from draftline.data.template import ChatEncoder, target_vocab_size
from draftline.errors import DraftlineError


def _token_ids(value, where: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DraftlineError(f"{where}: input_ids must be a non-empty list of integers")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise DraftlineError(
            f"{where}: token id {bad[0]} is outside the target's vocabulary [0, {vocab_size}); "
            "were these ids made with another tokenizer?"
        )
    return value


def read_prompts(
    path: str | Path, target_dir: str | Path, *, limit: int | None = None, thinking: bool | None = None
) -> list[list[int]]:
    """The prompts of ``path`` as token ids, in file order (the first ``limit`` if given).

    The file is read by ``draftline.data.readers`` (the one JSONL path; JSON and Parquet work too);
    unlike ``prepare``, a record that cannot be a prompt stops here, naming its file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DraftlineError(f"{path}: no such file; --prompts takes a JSONL file")
    vocab_size = target_vocab_size(target_dir)
    encoder: ChatEncoder | None = None
    prompts: list[list[int]] = []
    for source_record in readers.read_source(path, default_kind="jsonl"):
        if limit is not None and len(prompts) >= limit:
            break
        where = source_record.where
        try:
            record = readers.decode(source_record)
            if "input_ids" in record:
                prompts.append(_token_ids(record["input_ids"], where, vocab_size))
                continue
            if not isinstance(record.get("messages", record.get("conversations")), list):
                raise DraftlineError(f"{where}: neither input_ids nor messages (keys: {sorted(record)[:8]})")
            if encoder is None:  # only files with conversations need the tokenizer
                encoder = ChatEncoder(target_dir, thinking=thinking)
            messages = readers.prompt_messages(readers.conversation_to_regenerate(record))
            prompts.append(encoder.prompt_ids(messages))
        except readers.SkipRecord as exc:
            reason = readers.SKIP_REASONS.get(exc.reason, exc.reason)
            raise DraftlineError(f"{where}: {reason}" + (f" ({exc.detail})" if exc.detail else "")
                                 + "; fix or remove the record") from None
    if not prompts:
        raise DraftlineError(f"{path}: no prompts in the file")
    return prompts
