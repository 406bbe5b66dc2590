"""The target's chat template, and loss masks on exactly the tokens the target would generate.

The drafter learns to predict the target's replies, so the mask covers each assistant turn and the
end-of-turn token that closes it (so the drafter learns to stop), and nothing the template adds
around it (role headers, the generation prompt). Templates differ wildly, so the mask is not
guessed from token patterns; it is located in the rendered text and then checked:

1. Render the whole conversation once and tokenize it with offsets.
2. For assistant turn i, render turns 0..i-1 with the generation prompt. When that is a prefix of
   the full text, the turn starts where the prompt ends (what the template makes the model emit
   first, e.g. an empty think block, belongs to the reply). When it is not (templates that rewrite
   earlier turns, like Qwen3 dropping old reasoning), the turn starts at its content.
3. The content must appear verbatim after that start, followed (after whitespace only) by one of
   the target's end-of-turn tokens: its eos ids, and the special token the template itself writes
   right after a reply (ChatML's ``<|im_end|>``, also where the configs name another eos). The span
   runs from the start to the end of that token.
4. The tokens must tile each span exactly: no token straddles a span edge (the tokens between
   the edges then cover the rest). Anything else means the template moved or dropped the turn,
   and the record is skipped as a template mismatch rather than trained with a wrong mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from draftline.data.readers import MASK_MISMATCH, TEMPLATE_ERROR, SkipRecord
from draftline.errors import DraftlineError


def target_vocab_size(target_dir: str | Path) -> int:
    """``vocab_size`` of the target's (text) config.json: the rows of its embedding."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise DraftlineError(f"{target_dir}: no config.json; --target must be a Hugging Face model directory")
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise DraftlineError(f"{path}: no vocab_size; is this a causal language model's config?")
    return int(size)


def _eos_ids(target_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


def load_tokenizer(target_dir: str | Path):
    """The target's fast tokenizer, checked against its embedding size (a mismatch stops here)."""
    from transformers import AutoTokenizer

    target_dir = Path(target_dir)
    vocab_size = target_vocab_size(target_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception as exc:
        raise DraftlineError(f"{target_dir}: could not load the tokenizer ({exc}); the target directory needs tokenizer.json") from None
    if not getattr(tokenizer, "is_fast", False):
        raise DraftlineError(f"{target_dir}: the tokenizer is not a fast (Rust) tokenizer; masks need its offsets. Add a tokenizer.json.")
    if len(tokenizer) > vocab_size:
        raise DraftlineError(
            f"{target_dir}: the tokenizer has {len(tokenizer)} tokens but config.json says vocab_size {vocab_size}: "
            "token ids would fall outside the target's embedding. The tokenizer does not belong to this model; "
            "use the tokenizer files that came with the target."
        )
    return tokenizer


class ChatEncoder:
    """Renders and tokenizes conversations for one target; ``encode`` returns ids and a verified mask."""

    def __init__(self, target_dir: str | Path, *, thinking: bool | None = None):
        self.target_dir = Path(target_dir)
        self.tokenizer = load_tokenizer(target_dir)
        self.vocab_size = target_vocab_size(target_dir)
        template = self.tokenizer.chat_template
        if not template:
            raise DraftlineError(
                f"{target_dir}: the tokenizer has no chat_template (a base model?). Use an instruct target, "
                "or pass records already tokenized as input_ids + loss_mask."
            )
        self.template_has_thinking = "enable_thinking" in str(template)
        self._template_kwargs = {"enable_thinking": thinking} if thinking is not None and self.template_has_thinking else {}
        self._backend = self.tokenizer.backend_tokenizer
        eos_ids = _eos_ids(self.target_dir)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        end_of_turn = {self.tokenizer.convert_ids_to_tokens(i) for i in eos_ids if i is not None and i < len(self.tokenizer)}
        # What ends an assistant turn: the configs' eos ids and the token the template closes a reply with
        # (ChatML's <|im_end|>, where the configs may name another eos).
        closer = self._turn_closer()
        self.end_of_turn = sorted(end_of_turn | ({closer} if closer else set()))
        if not self.end_of_turn:
            raise DraftlineError(f"{target_dir}: no eos_token_id in the tokenizer or config, and the chat template "
                                 "closes no reply with a special token; cannot tell where a turn ends")

    def _turn_closer(self) -> str | None:
        """The special token the template writes right after an assistant's reply, found by rendering one
        (whitespace between them allowed); None where the template closes no reply with one."""
        probe = "draftline-reply-7c1e"
        messages = [{"role": "user", "content": "draftline-prompt"}, {"role": "assistant", "content": probe}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **self._template_kwargs)
        except Exception:  # noqa: BLE001 - a template with rules of its own (a system turn first, ...): none found
            return None
        at = text.rfind(probe)
        if at < 0:
            return None
        rest = text[at + len(probe):].lstrip()
        specials = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special), key=len,
                          reverse=True)
        return next((token for token in specials if token and rest.startswith(token)), None)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self._template_kwargs
            )
        except Exception as exc:  # jinja raise_exception(...): the template's own rule
            raise SkipRecord(TEMPLATE_ERROR, str(exc)[:200]) from None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the generation prompt (what generation starts from)."""
        text = self.render(messages, add_generation_prompt=True)
        return self._backend.encode(text, add_special_tokens=False).ids

    def assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of every assistant turn plus its end-of-turn token."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            gen_start = len(prompt) if len(prompt) >= cursor and text.startswith(prompt) else None
            search_from = cursor if gen_start is None else gen_start
            content = message["content"]
            pos = text.find(content, search_from)
            if pos < 0:
                content = content.strip()
                pos = text.find(content, search_from)
            if pos < 0:
                raise SkipRecord(MASK_MISMATCH, f"message {i} (assistant) does not appear verbatim in the rendered text")
            if gen_start is not None and any(eot in text[gen_start:pos] for eot in self.end_of_turn):
                raise SkipRecord(MASK_MISMATCH, f"message {i} (assistant) found only in a later turn of the rendered text")
            after = pos + len(content)
            rest = text[after : after + 256]
            gap = len(rest) - len(rest.lstrip())
            eot = next((t for t in self.end_of_turn if rest.startswith(t, gap)), None)
            if eot is None:
                raise SkipRecord(MASK_MISMATCH, f"message {i} (assistant) is not closed by an end-of-turn token ({', '.join(self.end_of_turn)})")
            end = after + gap + len(eot)
            spans.append((pos if gen_start is None else gen_start, end))
            cursor = end
        return spans

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int64 [T], loss_mask bool [T])`` of a conversation; ``SkipRecord`` if unverifiable."""
        text = self.render(messages)
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids = np.array(encoding.ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        # Only the tokens at span edges are looked at: all offsets as a numpy array would cost
        # more than the tokenization itself on long samples.
        for turn, (span_start, span_end) in enumerate(self.assistant_spans(messages, text), 1):
            first, last = encoding.char_to_token(span_start), encoding.char_to_token(span_end - 1)
            if first is None or last is None:
                raise SkipRecord(MASK_MISMATCH, f"assistant turn {turn}: its text is not covered by tokens")
            first_start = encoding.token_to_chars(first)[0]
            # a leading-space token ("_Hello" in SentencePiece) may start just before the turn
            if first_start < span_start and text[first_start:span_start].strip():
                raise SkipRecord(MASK_MISMATCH, f"assistant turn {turn}: a token straddles its start")
            if encoding.token_to_chars(last)[1] != span_end:
                raise SkipRecord(MASK_MISMATCH, f"assistant turn {turn}: a token straddles its end")
            mask[first : last + 1] = True
        return ids, mask
