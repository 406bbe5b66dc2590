"""Local generation on several processes: the replies of one process, a failing or dying worker named."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from draftline.cli import main
from draftline.data.generate import LocalGenerator
from draftline.data.generate_pool import GeneratorPool, worker_devices
from draftline.data.regenerate import regenerate
from draftline.errors import DraftlineError


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_two_workers_write_what_one_process_writes(chat_target, tmp_path, conversation, write_jsonl):
    # 7 records, batches of 2: groups of 4 on two workers make the batches groups of 2 make in one process
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=1 + i % 2) for i in range(7)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = LocalGenerator(chat_target, max_new_tokens=8, batch_size=2)
        regenerate(source, tmp_path / "one.jsonl", one, group_size=2, progress=False)
    finally:
        torch.set_num_threads(threads)
    pool = GeneratorPool(chat_target, 2, batch_size=2, max_new_tokens=8, device="cpu")
    processes = [process for _, process in pool._workers]
    try:
        assert pool.device.startswith("2 processes on cpu")
        stats = regenerate(source, tmp_path / "two.jsonl", pool, group_size=4, progress=False)
        assert pool.complete([]) == []
    finally:
        pool.close()
    assert stats["regenerated"] == 7
    assert _lines(tmp_path / "two.jsonl") == _lines(tmp_path / "one.jsonl")
    assert [p.exitcode for p in processes] == [0, 0]  # told to stop, they ended by themselves


def test_a_worker_that_cannot_load_the_target_is_named(tmp_path):
    with pytest.raises(DraftlineError, match=r"regenerate worker \d \(pid \d+\): .*no-such-target: no config.json"):
        GeneratorPool(tmp_path / "no-such-target", 2, device="cpu")


def test_a_dead_worker_is_named_with_its_exit_code(chat_target):
    pool = GeneratorPool(chat_target, 2, batch_size=2, max_new_tokens=4, device="cpu")
    try:
        victim = pool._workers[1][1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(DraftlineError, match=rf"regenerate worker 1 \(pid {victim.pid}\) died \(exit code -9\)"):
            pool.complete([[{"role": "user", "content": "hi"}]] * 4)
    finally:
        pool.close()


def test_cpu_workers_share_the_cores_and_gpus_are_counted(monkeypatch):
    monkeypatch.setattr("draftline.data.generate_pool.usable_cores", lambda: 8)
    assert worker_devices(2, "cpu") == (["cpu", "cpu"], 4)
    assert worker_devices(3, "cpu") == (["cpu"] * 3, 2)
    assert worker_devices(16, "cpu") == (["cpu"] * 16, 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker_devices(2, "cuda") == (["cuda:0", "cuda:1"], None)
    with pytest.raises(DraftlineError, match="--workers 3: this machine has 2 GPU"):
        worker_devices(3, "cuda")


@pytest.mark.parametrize("extra, message", [
    (["--target", "t", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["--endpoint", "http://localhost:1/v1", "--model", "m", "--workers", "2"], "--workers is for local generation"),
])
def test_the_command_refuses_a_wrong_worker_count(tmp_path, write_jsonl, conversation, capsys, extra, message):
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(0)])
    code = main(["regenerate", "--input", source, "--out", str(tmp_path / "out.jsonl"), *extra])
    assert code != 0 and message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_ctrl_c_of_a_run_on_two_workers_ends_with_the_continue_message(chat_target, tmp_path, conversation,
                                                                        write_jsonl):
    """Ctrl-C in a terminal reaches the command and its workers at once: the command's own message and exit
    code 130, no traceback, the records already written kept."""
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(400)])
    out = tmp_path / "out.jsonl"
    # A command started in a terminal's foreground has SIGINT's default disposition. A test session started in
    # the background of a non-interactive shell (`pytest &`) ignores SIGINT, and an ignored signal stays
    # ignored across exec: Python then never raises KeyboardInterrupt, and the run went on to its end.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler is reset to SIG_DFL by exec
    try:
        proc = subprocess.Popen([sys.executable, "-m", "draftline", "regenerate", "--target", str(chat_target),
                                 "--input", source, "--out", str(out), "--batch-size", "2", "--max-new-tokens", "16",
                                 "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    deadline = time.time() + 120
    while not (out.exists() and out.stat().st_size > 0) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted; finished records are in" in stdout and "Traceback" not in stderr, stdout + stderr
    assert 0 < len(_lines(out)) < 400
