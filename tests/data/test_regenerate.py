import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftline.data.generate import EndpointGenerator, LocalGenerator, Reply, chat_completions_url, split_reasoning
from draftline.data.regenerate import failed_path, load_done, regenerate


class EchoGenerator:
    """Replies name the last user turn and how many assistant turns the prompt already holds."""

    def __init__(self, interrupt_after: int | None = None):
        self.calls = []
        self.interrupt_after = interrupt_after

    def complete(self, conversations):
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(conversations)
        return [Reply(content=_echo(c)) for c in conversations]


def _echo(conversation):
    previous = [m["content"] for m in conversation if m["role"] == "assistant"]
    return f"re[{conversation[-1]['content']}] after {previous}"


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_turn_by_turn_from_the_regenerated_history(tmp_path, conversation, write_jsonl):
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=3) for i in range(5)])
    stats = regenerate(source, tmp_path / "out.jsonl", EchoGenerator(), group_size=2, progress=False)
    assert stats["regenerated"] == 5 and stats["failed"] == 0
    for line in _lines(tmp_path / "out.jsonl"):
        replies = [m["content"] for m in line["messages"] if m["role"] == "assistant"]
        users = [m["content"] for m in line["messages"] if m["role"] == "user"]
        assert replies[0] == f"re[{users[0]}] after []"
        assert replies[2] == f"re[{users[2]}] after {replies[:2]}"  # turn 3 saw the regenerated turns 1 and 2
        assert line["id"] == f"c{line['source_index']}"


def test_prompt_only_records_get_a_reply_and_empty_replies_are_filled(tmp_path, write_jsonl):
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"messages": [{"role": "user", "content": "just a prompt"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": ""}, {"from": "human", "value": "b"}]},
        {"messages": [{"role": "system", "content": "nobody asks"}]},
    ])
    stats = regenerate(source, tmp_path / "out.jsonl", EchoGenerator(), progress=False)
    first, second = _lines(tmp_path / "out.jsonl")
    assert first["messages"][-1] == {"role": "assistant", "content": "re[just a prompt] after []"}
    assert [m["content"] for m in second["messages"]] == ["a", "re[a] after []", "b", "re[b] after ['re[a] after []']"]
    assert stats["failure_kinds"] == {"no_user_turn": 1}


def test_resume_after_a_kill_has_no_duplicates_and_nothing_missing(tmp_path, conversation, write_jsonl):
    records = [conversation(i, turns=1 + i % 2) for i in range(11)] + [{"messages": [{"role": "tool", "content": "?"}]}, "{broken"]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt):  # killed in the middle of the third group
        regenerate(source, out, EchoGenerator(interrupt_after=5), group_size=3, progress=False)
    first = _lines(out)
    assert len(first) == 6
    with open(out, "a") as f:  # and a write cut short
        f.write('{"source_index": 6, "messa')
    assert load_done(out) == set(range(6)) and out.read_text().endswith("}\n")
    stats = regenerate(source, out, EchoGenerator(), group_size=3, progress=False)
    assert stats["already_done"] == 6 and stats["regenerated"] == 5 and stats["failed"] == 2
    indices = [line["source_index"] for line in _lines(out)]
    assert sorted(indices) == list(range(11)) and _lines(out)[:6] == first
    failed = {f["source_index"]: f for f in _lines(failed_path(out))}
    assert failed[11]["kind"] == "unknown_role" and failed[12]["kind"] == "malformed_json"
    assert "in.jsonl:13" in failed[12]["where"]
    # a third run has nothing left but the failures, which it retries and reports again
    stats = regenerate(source, out, EchoGenerator(), group_size=3, progress=False)
    assert (stats["already_done"], stats["regenerated"], stats["failed"]) == (11, 0, 2)


class SlowGenerator(EchoGenerator):
    """Each batch of replies takes ``seconds``."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def complete(self, conversations):
        import time

        time.sleep(self.seconds)
        return super().complete(conversations)


def test_a_time_limit_stops_between_groups_and_the_same_call_continues(tmp_path, conversation, write_jsonl):
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=1) for i in range(12)])
    out = tmp_path / "out.jsonl"
    stats = regenerate(source, out, SlowGenerator(0.3), group_size=2, progress=False, max_seconds=0.75)
    assert stats["time_up"] and stats["regenerated"] == 6  # groups started at 0, 0.3, 0.6 s; none at 0.9
    assert [line["source_index"] for line in _lines(out)] == list(range(6))
    stats = regenerate(source, out, SlowGenerator(0.0), group_size=2, progress=False, max_seconds=60)
    assert not stats["time_up"] and (stats["already_done"], stats["regenerated"]) == (6, 6)
    assert sorted(line["source_index"] for line in _lines(out)) == list(range(12))


def test_local_generation_with_the_target(chat_target, tmp_path, conversation, write_jsonl):
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=1 + i % 2) for i in range(3)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend
    try:
        generator = LocalGenerator(chat_target, max_new_tokens=6, batch_size=2)
        stats = regenerate(source, tmp_path / "out.jsonl", generator, group_size=2, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert stats["regenerated"] + stats["failed"] == 3
    for line in _lines(tmp_path / "out.jsonl"):
        original = conversation(line["source_index"], turns=1 + line["source_index"] % 2)["messages"]
        assert [m["role"] for m in line["messages"]] == [m["role"] for m in original]
        assert all(m["content"] != o["content"] for m, o in zip(line["messages"], original) if m["role"] == "assistant")
        assert set(line["finish_reasons"]) <= {"stop", "length"}


@contextmanager
def fake_server(respond):
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append((self.path, body))
            status, payload = respond(body, len(requests))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_with_retries_and_failures(tmp_path, conversation, write_jsonl):
    flaky_seen = set()

    def respond(body, _count):
        last = body["messages"][-1]["content"]
        if "Question 3." in last:
            return 400, {"error": "prompt too long"}
        if "Question 2." in last and last not in flaky_seen:  # a busy server: fails once, then answers
            flaky_seen.add(last)
            return 503, {"error": "overloaded"}
        reply = "<think>\nhmm\n</think>\n\n" + _echo(body["messages"])
        return 200, {"choices": [{"message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]}

    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=2) for i in range(6)])
    with fake_server(respond) as (url, requests):
        generator = EndpointGenerator(url, "target", concurrency=3, max_new_tokens=32, thinking=False, backoff_s=0.01)
        stats = regenerate(source, tmp_path / "out.jsonl", generator, group_size=4, progress=False)
        generator.close()
    assert stats["regenerated"] == 5 and stats["failed"] == 1 and stats["failure_kinds"] == {"generation_failed": 1}
    (failure,) = _lines(failed_path(tmp_path / "out.jsonl"))
    assert failure["source_index"] == 3 and "HTTP 400" in failure["reason"] and "prompt too long" in failure["reason"]
    path, body = requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "target" and body["max_tokens"] == 32
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    for line in _lines(tmp_path / "out.jsonl"):
        first = next(m for m in line["messages"] if m["role"] == "assistant")
        assert first["reasoning_content"] == "hmm" and first["content"].startswith("re[")


def test_small_helpers():
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/x/chat/completions") == "http://h:1/x/chat/completions"
    assert split_reasoning("<think>\nR\n</think>\n\nC") == ("C", "R")
    assert split_reasoning("plain") == ("plain", None)
