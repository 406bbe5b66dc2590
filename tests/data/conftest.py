"""Fixtures for the data tests: one tiny chat target per session, and small conversation files."""

from __future__ import annotations

import json

import pytest
from chat_target import make_chat_target


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    return make_chat_target(tmp_path_factory.mktemp("chat_target"))


def _conversation(i: int, turns: int = 2) -> dict:
    messages = [{"role": "system", "content": "You are a helpful model."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: what is the answer?"})
        messages.append({"role": "assistant", "content": f"The answer {i} is " + "yes " * (i % 7 + t) + "ok."})
    return {"id": f"c{i}", "messages": messages}


def _write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


# Fixtures rather than imports: with --import-mode=importlib a test cannot import this conftest.
@pytest.fixture
def conversation():
    """``conversation(i, turns=2)``: a system prompt and ``turns`` user/assistant exchanges."""
    return _conversation


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, records)``: dicts as JSON lines, strings written as they are."""
    return _write_jsonl
