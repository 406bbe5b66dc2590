"""After torchrun: the rank it saw die first named from the rank's own record in the run dir; the exit code of a
launch stopped by a signal."""

from __future__ import annotations

import json
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from draftline.distributed.postmortem import name_failed_rank, stopped_exit_code


def _killed(pid: int) -> ProcessFailure:
    return ProcessFailure(local_rank=2, pid=pid, exitcode=-signal.SIGKILL, error_file="/nonexistent")


def test_a_killed_rank_is_named_with_role_host_gpu_and_signal(tmp_path):
    (tmp_path / "ranks").mkdir()
    info = {"rank": 2, "role": "target", "host": "node7", "gpu": "GPU 2 NVIDIA H200", "pid": 4242}
    (tmp_path / "ranks" / "rank-2.json").write_text(json.dumps(info))
    message = name_failed_rank(tmp_path, 2, _killed(4242), started=time.time())
    assert message == "target rank 2 (host node7, GPU 2 NVIDIA H200, pid 4242) died (killed by SIGKILL)"
    assert json.loads((tmp_path / "failure.json").read_text())["message"] == message


def test_a_rank_report_from_this_launch_is_kept_an_old_one_replaced(tmp_path):
    started = time.time()
    (tmp_path / "failure.json").write_text(json.dumps({"time": started + 1, "message": "drafter rank 0 failed: OOM"}))
    name_failed_rank(tmp_path, 2, _killed(1), started=started)
    assert "OOM" in json.loads((tmp_path / "failure.json").read_text())["message"]
    (tmp_path / "failure.json").write_text(json.dumps({"time": started - 100, "message": "from an earlier attempt"}))
    message = name_failed_rank(tmp_path, 2, _killed(1), started=started)
    assert message == "rank 2 (pid 1) died (killed by SIGKILL)"  # no rank record: what torchrun knows
    assert json.loads((tmp_path / "failure.json").read_text())["message"] == message


def test_the_launchers_exit_code_after_a_signal_is_the_runs(tmp_path, capsys):
    started = time.time()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "end", "time": started - 50, "status": "stopped"}) + "\n")
    # Only an end record of this launch counts: the one above is an earlier start's.
    assert stopped_exit_code(tmp_path, signal.SIGTERM, started) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM before the run saved a checkpoint of its stop" in capsys.readouterr().err
    with metrics.open("a") as f:
        f.write(json.dumps({"kind": "train", "time": started + 1}) + "\n")
        f.write(json.dumps({"kind": "end", "time": started + 2, "status": "stopped"}) + "\n")
    assert stopped_exit_code(tmp_path, signal.SIGTERM, started) == 0
    with metrics.open("a") as f:
        f.write(json.dumps({"kind": "end", "time": started + 3, "status": "failed"}) + "\n")
    assert stopped_exit_code(tmp_path, signal.SIGINT, started) == 1
