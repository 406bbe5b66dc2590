"""The launcher names the rank torchrun saw die first, from the rank's own record in the run dir."""

from __future__ import annotations

import json
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from draftline.commands.train import _name_failed_rank


def _killed(pid: int) -> ProcessFailure:
    return ProcessFailure(local_rank=2, pid=pid, exitcode=-signal.SIGKILL, error_file="/nonexistent")


def test_a_killed_rank_is_named_with_role_host_gpu_and_signal(tmp_path):
    (tmp_path / "ranks").mkdir()
    info = {"rank": 2, "role": "target", "host": "node7", "gpu": "GPU 2 NVIDIA H200", "pid": 4242}
    (tmp_path / "ranks" / "rank-2.json").write_text(json.dumps(info))
    message = _name_failed_rank(tmp_path, 2, _killed(4242), started=time.time())
    assert message == "target rank 2 (host node7, GPU 2 NVIDIA H200, pid 4242) died (killed by SIGKILL)"
    assert json.loads((tmp_path / "failure.json").read_text())["message"] == message


def test_a_rank_report_from_this_launch_is_kept_an_old_one_replaced(tmp_path):
    started = time.time()
    (tmp_path / "failure.json").write_text(json.dumps({"time": started + 1, "message": "drafter rank 0 failed: OOM"}))
    _name_failed_rank(tmp_path, 2, _killed(1), started=started)
    assert "OOM" in json.loads((tmp_path / "failure.json").read_text())["message"]
    (tmp_path / "failure.json").write_text(json.dumps({"time": started - 100, "message": "from an earlier attempt"}))
    message = _name_failed_rank(tmp_path, 2, _killed(1), started=started)
    assert message == "rank 2 (pid 1) died (killed by SIGKILL)"  # no rank record: what torchrun knows
    assert json.loads((tmp_path / "failure.json").read_text())["message"] == message


def test_cpu_ranks_are_launched_with_sleeping_openmp_threads(monkeypatch):
    """Several CPU ranks share the cores: spinning OpenMP threads would slow the busy rank down."""
    import os

    from draftline.commands.train import _cpu_launch_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _cpu_launch_env("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stays
    _cpu_launch_env("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    _cpu_launch_env("cuda")
    assert "OMP_WAIT_POLICY" not in os.environ
