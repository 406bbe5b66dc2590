"""A stop by SIGINT or SIGTERM, of one process or of the ``--gpus N`` launcher: the checkpoint
message, exit code 0, no traceback; before training, one line and 128 + the signal."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from draftline.checkpoint.state import latest_checkpoint
from draftline.cli import main
from draftline.commands import train as train_command
from draftline.distributed.signals import SAME_REQUEST_S, Interrupted, StopSignals
from line_helpers import ENV, base_args, read_jsonl, start, wait_until


def _stop(proc, out, signum, *, also_ranks=False, timeout=180):
    wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 2, timeout, "2 steps", proc)
    pids = [proc.pid]
    if also_ranks:  # a scheduler (Slurm, systemd) signals every process of the job, not only the launcher
        pids += [json.loads(p.read_text())["pid"] for p in (out / "ranks").glob("rank-*.json")]
    for pid in pids:
        os.kill(pid, signum)
    return proc.communicate(timeout=timeout)


def _assert_clean_stop(proc, out, out_text, err_text):
    assert proc.returncode == 0, err_text[-3000:]
    assert "Traceback" not in err_text and "SignalException" not in err_text, err_text[-3000:]
    stopped_at = int(latest_checkpoint(out).name.split("-")[-1])
    assert f"stopped at step {stopped_at}; checkpoint {out / 'checkpoints'}" in out_text
    assert "continue with the same command and --resume" in out_text


def _long_run(qwen3_target, line_data, out):
    return base_args(qwen3_target, line_data, out, epochs=200, save_every=1000, trace=True)


@pytest.mark.slow
def test_sigterm_to_a_single_process_stops_with_its_checkpoint(qwen3_target, line_data, tmp_path):
    out = tmp_path / "run"
    proc = start(_long_run(qwen3_target, line_data, out))
    out_text, err_text = _stop(proc, out, signal.SIGTERM)
    _assert_clean_stop(proc, out, out_text, err_text)


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_every_rank_with_the_checkpoint(qwen3_target, line_data, tmp_path):
    """Ctrl-C in a terminal reaches the launcher only (torchrun starts each rank in its own session);
    torchrun passes it on. No torchrun traceback after the ranks stopped, no OMP_NUM_THREADS banner."""
    out = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    proc = start([*_long_run(qwen3_target, line_data, out), "--gpus", "2"], env=env)
    out_text, err_text = _stop(proc, out, signal.SIGINT)
    _assert_clean_stop(proc, out, out_text, err_text)
    assert "OMP_NUM_THREADS" not in err_text


@pytest.mark.slow
def test_sigterm_to_the_launcher_and_its_ranks_at_once_stops_with_the_checkpoint(qwen3_target, line_data, tmp_path):
    """The launcher's forwarded copy reaches each rank just after the scheduler's own: one request."""
    out = tmp_path / "run"
    proc = start([*_long_run(qwen3_target, line_data, out), "--gpus", "2"])
    out_text, err_text = _stop(proc, out, signal.SIGTERM, also_ranks=True)
    _assert_clean_stop(proc, out, out_text, err_text)


# ---------------------------------------------------------------------------------------------------- in-process


def test_a_repeat_within_a_moment_is_the_same_request_a_later_one_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    try:
        stops = StopSignals()
        stops._handle(signal.SIGTERM, None)
        assert stops.requested and not exits
        clock[0] += SAME_REQUEST_S / 4
        stops._handle(signal.SIGTERM, None)  # the launcher's forwarded copy
        assert not exits
        clock[0] += SAME_REQUEST_S
        stops._handle(signal.SIGINT, None)  # the user insists
        assert exits == [128 + signal.SIGINT]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_stop_before_training_is_one_line_and_128_plus_the_signal(monkeypatch, capsys):
    def interrupted(_args):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(train_command, "run", interrupted)
    assert main(["train", "--out", "x"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "draftline train: stopped by SIGTERM before training began: nothing was saved" in err
    assert "Traceback" not in err


def test_an_in_process_run_gives_the_signal_handlers_back(qwen3_target, line_data, tmp_path):
    """`draftline train` called inside a process that goes on (a test session): afterwards SIGTERM and SIGINT
    do what they did before; left to StopSignals, a SIGTERM would only ask a finished run to stop."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert main(["train", *base_args(qwen3_target, line_data, tmp_path / "run", max_steps=2)]) == 0
    assert main(["train", *base_args(qwen3_target, line_data, tmp_path / "bad", max_steps=2), "--lr", "-1"]) == 2
    assert {sig: signal.getsignal(sig) for sig in before} == before
