"""The launcher's environment for its ranks: sleeping OpenMP threads on CPU, the cores shared out; the
command passed on without the launcher's own flags."""

from __future__ import annotations

import os

from draftline.distributed.launch import cpu_launch_env, launch_env, rank_argv, threads_per_rank


def test_cpu_ranks_are_launched_with_sleeping_openmp_threads(monkeypatch):
    """Several CPU ranks share the cores: spinning OpenMP threads would slow the busy rank down."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpu_launch_env("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stays
    cpu_launch_env("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    cpu_launch_env("cuda")
    assert "OMP_WAIT_POLICY" not in os.environ


def test_launched_ranks_share_the_cores_out(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert [threads_per_rank(n) for n in (1, 2, 3, 8, 32)] == [16, 8, 5, 2, 1]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    launch_env("cuda", 4)
    assert os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stays
    launch_env("cuda", 4)
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_the_ranks_get_the_command_without_the_launchers_flags():
    argv = ["--target", "t", "--gpus", "4", "--out", "o", "--max-restarts=2", "--nproc", "4", "--gpus=4", "--trace"]
    assert rank_argv(argv) == ["--target", "t", "--out", "o", "--trace"]
