"""A run directory belongs to one live run: RUN_DIR/run.lock, refused while its owner lives, taken over after."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from draftline import run_files
from draftline.cli import main
from draftline.distributed import rundir
from draftline.errors import DraftlineError
from line_helpers import base_args, read_jsonl, run, start, wait_until


@pytest.fixture(autouse=True)
def _no_lock_left():
    yield
    rundir.release_run_lock()


def _write_lock(run_dir, age_s: float = 0.0, **fields):
    """A lock as another process would have left it (this host and a live pid unless told otherwise)."""
    owner = dataclasses.replace(rundir.this_process(), **fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / run_files.LOCK
    path.write_text(json.dumps(dataclasses.asdict(owner)))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return owner


@pytest.fixture
def other_process():
    """A live process of this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _pid_start(pid: int) -> str:
    return rundir._proc_stat(pid)[1]


def test_a_live_run_on_this_host_keeps_its_directory(tmp_path, other_process):
    _write_lock(tmp_path, pid=other_process.pid, pid_start=_pid_start(other_process.pid))
    with pytest.raises(DraftlineError, match=rf"belongs to a live run \(host {socket.gethostname()}, "
                                             rf"pid {other_process.pid}, started .*that process runs on this host"):
        rundir.acquire_run_lock(tmp_path)
    with pytest.raises(DraftlineError, match=f"pid {other_process.pid}"):
        rundir.check_run_dir_free(tmp_path)  # the launcher's look, before it starts any rank
    assert json.loads((tmp_path / run_files.LOCK).read_text())["pid"] == other_process.pid  # untouched


def _dead_pid() -> int:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(ended.stdout)


def test_a_dead_runs_lock_is_taken_over_with_a_message(tmp_path, capsys):
    dead_pid = _dead_pid()
    _write_lock(tmp_path, pid=dead_pid, pid_start="1")
    assert rundir.live_owner(tmp_path) is None
    lock = rundir.acquire_run_lock(tmp_path)
    err = capsys.readouterr().err
    assert f"was left by a run that has ended (host {socket.gethostname()}, pid {dead_pid}" in err
    assert "that process no longer runs" in err and "this run takes it over" in err
    assert json.loads(lock.path.read_text())["pid"] == os.getpid() and lock.holds()


def test_a_reused_pid_or_a_reboot_is_not_the_run(tmp_path, other_process, capsys):
    _write_lock(tmp_path, pid=other_process.pid, pid_start="12345")  # the pid now names another process
    rundir.acquire_run_lock(tmp_path)
    assert "that process no longer runs" in capsys.readouterr().err
    rundir.release_run_lock()
    _write_lock(tmp_path, pid=other_process.pid, pid_start=_pid_start(other_process.pid), boot_id="an-earlier-boot")
    rundir.acquire_run_lock(tmp_path)
    assert "the host has rebooted since" in capsys.readouterr().err


def test_another_hosts_run_is_live_until_its_heartbeat_goes_stale(tmp_path, capsys):
    _write_lock(tmp_path, host="node-elsewhere", pid=1, age_s=rundir.STALE_S / 2)
    with pytest.raises(DraftlineError, match=r"host node-elsewhere, pid 1, .*refreshed \d+ s ago from host "
                                             r"node-elsewhere.*if host node-elsewhere is down, the lock counts"):
        rundir.acquire_run_lock(tmp_path)
    _write_lock(tmp_path, host="node-elsewhere", pid=1, age_s=rundir.STALE_S + 5)
    rundir.acquire_run_lock(tmp_path)
    assert "not refreshed for" in capsys.readouterr().err


def test_a_torchrun_restart_takes_over_its_previous_attempts_lock(tmp_path, monkeypatch, capsys):
    # Multi-node: rank 0 of the restarted job may run on another host than the attempt before.
    _write_lock(tmp_path, host="node-elsewhere", pid=1, run_id="job-7", restart=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = rundir.acquire_run_lock(tmp_path)
    assert "attempt 0 of this torchrun job (this is attempt 1)" in capsys.readouterr().err
    assert lock.owner.restart == 1
    rundir.release_run_lock()
    _write_lock(tmp_path, host="node-elsewhere", pid=1, run_id="job-8", restart=0)  # another job: live
    with pytest.raises(DraftlineError, match="torchrun job job-8 attempt 0"):
        rundir.acquire_run_lock(tmp_path)


def test_release_gives_up_only_its_own_lock_and_the_directory_it_created(tmp_path):
    run_dir = tmp_path / "new"
    lock = rundir.acquire_run_lock(run_dir)
    assert lock.path.is_file()
    rundir.release_run_lock()
    assert not run_dir.exists()  # refused or failed before writing anything: no empty directory left

    lock = rundir.acquire_run_lock(tmp_path)
    taken = _write_lock(tmp_path, host="node-elsewhere", pid=1)  # judged dead by another start, taken over
    rundir.release_run_lock()
    assert json.loads(lock.path.read_text())["token"] == taken.token


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    lock = rundir.acquire_run_lock(tmp_path)
    old = time.time() - 100
    os.utime(lock.path, (old, old))
    wait_until(lambda: time.time() - lock.path.stat().st_mtime < 10, 5, "a heartbeat")


def test_of_starts_racing_for_a_dead_runs_lock_exactly_one_wins(tmp_path):
    """Starts on four hosts sharing the directory judge the same dead lock at the same moment: one
    takes it over, the others find it live and are refused naming that one."""
    _write_lock(tmp_path, host="node-gone", pid=1, age_s=rundir.STALE_S + 5)
    racers = [dataclasses.replace(rundir.this_process(), host=f"node-{i}", token=f"racer-{i}") for i in range(4)]
    barrier = threading.Barrier(len(racers))
    verdicts = {}

    def race(me):
        barrier.wait()
        try:
            rundir.take_lock(tmp_path, me)
            verdicts[me.host] = "owner"
        except Exception as exc:  # noqa: BLE001 - anything else fails the test below, shown
            verdicts[me.host] = repr(exc)

    threads = [threading.Thread(target=race, args=(me,)) for me in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [host for host, verdict in verdicts.items() if verdict == "owner"]
    assert len(verdicts) == 4 and len(winners) == 1, verdicts
    assert json.loads((tmp_path / run_files.LOCK).read_text())["host"] == winners[0]
    for host, verdict in verdicts.items():
        if host != winners[0]:
            assert f"belongs to a live run (host {winners[0]}, pid {os.getpid()}" in verdict


@pytest.mark.slow
def test_a_second_train_into_a_live_runs_directory_is_refused(qwen3_target, line_data, tmp_path, capsys):
    """Two real runs: the second, with --from-scratch or --resume, alone or launched with --gpus,
    is refused naming the live run's host and pid, and leaves the live run's files alone."""
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, epochs=200, save_every=2, trace=True)
    live = start(args)
    try:
        wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 3, 120, "3 steps", live)
        lock = json.loads((out / run_files.LOCK).read_text())
        assert lock["pid"] == live.pid and lock["host"] == socket.gethostname()
        refused = f"belongs to a live run (host {socket.gethostname()}, pid {live.pid},"
        capsys.readouterr()
        assert main(["train", *args, "--from-scratch"]) == 2  # alone: in this process, a process's imports saved
        err = capsys.readouterr().err
        assert refused in err and "Traceback" not in err, err[-3000:]
        second = run([*args, "--resume", "--gpus", "2"], timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert refused in second.stderr and "Traceback" not in second.stderr
        assert live.poll() is None
        assert not list(out.glob("previous-*")) and not (out / "failure.json").exists()
    finally:
        live.send_signal(signal.SIGINT)
        out_text, err_text = live.communicate(timeout=120)
    assert live.returncode == 0, err_text[-3000:]
    assert not (out / run_files.LOCK).exists()  # released at exit
