"""Where regenerated replies come from: the target itself (batched ``generate``) or an
OpenAI-compatible chat-completions server (vLLM, SGLang, ...), behind one small interface::

    generator.complete([conversation, ...]) -> [Reply, ...]   # one reply per conversation, same order

A failure is a ``Reply`` with ``error`` set, never an exception: one bad request must not cost the
rest of the batch, and the caller records every failure with its reason.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from draftline.errors import DraftlineError


@dataclass
class Reply:
    content: str = ""
    reasoning: str | None = None  # a thinking block, split from the content
    finish_reason: str = "stop"  # "length": cut by max_new_tokens
    error: str | None = None


def split_reasoning(text: str) -> tuple[str, str | None]:
    """``"<think>R</think>C"`` -> ``("C", "R")``; chat templates of reasoning models render the
    reasoning from its own field (``reasoning_content``), not from the content."""
    if "</think>" not in text:
        return text, None
    reasoning, _, content = text.partition("</think>")
    reasoning = reasoning.split("<think>", 1)[-1].strip("\n")
    return content.lstrip("\n"), reasoning or None


def _reply(text: str, finish_reason: str, reasoning: str | None = None) -> Reply:
    content, split = split_reasoning(text)
    reasoning = reasoning or split
    if not content.strip():
        return Reply(error="empty reply" + (" (only reasoning; raise --max-new-tokens?)" if reasoning else ""))
    return Reply(content=content, reasoning=reasoning, finish_reason=finish_reason)


class LocalGenerator:
    """The target model, batched ``generate`` with left padding; on the GPU when there is one."""

    def __init__(self, target_dir: str | Path, *, max_new_tokens: int = 1024, temperature: float = 0.0,
                 batch_size: int = 8, thinking: bool | None = None, device: str | None = None, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        from draftline.data.template import ChatEncoder

        self.chat = ChatEncoder(target_dir, thinking=thinking)
        self.tokenizer = self.chat.tokenizer
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(self.device).eval()
        self.eos_ids = sorted(self.tokenizer.convert_tokens_to_ids(self.chat.end_of_turn))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        torch.manual_seed(seed)

    def complete(self, conversations: list[list[dict]]) -> list[Reply]:
        import torch

        prompts = []
        for conversation in conversations:
            try:
                prompts.append(self.chat.prompt_ids(conversation))
            except Exception as exc:  # the template refused it (SkipRecord): this reply fails, not the batch
                prompts.append(exc)
        replies: list[Reply] = [Reply(error=f"chat template: {p}") if isinstance(p, Exception) else Reply() for p in prompts]
        # similar lengths together: less padding per generate call
        order = sorted((i for i, p in enumerate(prompts) if not isinstance(p, Exception)), key=lambda i: len(prompts[i]))
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            width = max(len(prompts[i]) for i in rows)
            input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):  # left padding: every row's next token lands at the same column
                input_ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                attention_mask[r, width - len(prompts[i]):] = 1
            sampling = {"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else {"do_sample": False}
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                    max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **sampling,
                )
            for r, i in enumerate(rows):
                new = out[r, width:].tolist()
                stop = next((k for k, t in enumerate(new) if t in self.eos_ids), None)
                tokens = new if stop is None else new[:stop]
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                replies[i] = _reply(text, "length" if stop is None else "stop")
        return replies

    def close(self) -> None:
        pass


def chat_completions_url(endpoint: str) -> str:
    """Accept ``http://host:port``, ``.../v1`` or the full ``.../v1/chat/completions``."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class EndpointGenerator:
    """An OpenAI-compatible server, ``concurrency`` requests in flight, retries on transient errors.

    Retried: connection errors, timeouts, HTTP 429 and 5xx (a busy or restarting server). Not
    retried: other 4xx, which a retry cannot fix (wrong model name, prompt too long).
    """

    def __init__(self, endpoint: str, model: str, *, concurrency: int = 16, max_new_tokens: int = 1024,
                 temperature: float = 0.0, thinking: bool | None = None, retries: int = 3, timeout_s: float = 600.0,
                 backoff_s: float = 1.0):
        if concurrency < 1:
            raise DraftlineError(f"--concurrency must be >= 1, got {concurrency}")
        self.url = chat_completions_url(endpoint)
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.thinking = thinking
        self.retries = retries
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="regenerate")

    def _body(self, conversation: list[dict]) -> bytes:
        body = {"model": self.model, "messages": conversation, "max_tokens": self.max_new_tokens, "temperature": self.temperature}
        if self.thinking is not None:  # vLLM and SGLang pass this on to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        return json.dumps(body).encode()

    def _request(self, conversation: list[dict]) -> Reply:
        headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        request = urllib.request.Request(self.url, data=self._body(conversation), headers=headers, method="POST")
        error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    data = json.loads(response.read())
                choice = data["choices"][0]
                message = choice.get("message") or {}
                reasoning = message.get("reasoning_content") or message.get("reasoning")
                return _reply(message.get("content") or "", choice.get("finish_reason") or "stop", reasoning)
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                error = f"HTTP {exc.code}: {detail}"
                if exc.code != 429 and exc.code < 500:
                    return Reply(error=error)
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                error = f"malformed response: {exc}"
        return Reply(error=f"{error} (after {self.retries + 1} attempts)")

    def complete(self, conversations: list[list[dict]]) -> list[Reply]:
        return list(self._pool.map(self._request, conversations))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
