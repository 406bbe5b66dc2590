"""The launcher: names the rank torchrun saw die first (from the rank's own record in the run dir),
launches for --gpus or a config file's topology.gpus, restarts with --max-restarts."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
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


def test_topology_gpus_in_a_config_file_launches_like_the_flag(tmp_path, monkeypatch):
    from draftline.cli import main
    from draftline.commands import train as train_command

    launched = []
    monkeypatch.setattr(train_command, "_launch", lambda gpus, restarts, argv, out, device: launched.append(
        (gpus, restarts, out)) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    config = tmp_path / "run.toml"
    config.write_text(f'out = "{tmp_path / "run"}"\n[model]\ntarget = "t"\n[data]\ndata = ["d"]\n'
                      '[topology]\ngpus = 2\ndevice = "cpu"\n')
    assert main(["train", "--config", str(config), "--max-restarts", "1"]) == 0
    assert launched == [(2, 1, str(tmp_path / "run"))]
    assert main(["train", "--config", str(config), "--gpus", "3"]) == 0  # the flag overrides the file
    assert launched[-1][0] == 3

    # A rank torchrun started reads the same file: it runs its part, it does not launch again.
    trained = []
    import draftline.pipeline.run

    monkeypatch.setattr(draftline.pipeline.run, "run_training", lambda cfg: trained.append(cfg.topology.gpus) or 0)
    monkeypatch.setattr(train_command, "_die_with_launcher", lambda: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--config", str(config)]) == 0
    assert trained == [2] and len(launched) == 2


def test_max_restarts_without_a_launch_is_refused(capsys):
    from draftline.cli import main

    assert main(["train", "--target", "t", "--data", "d", "--out", "o", "--max-restarts", "1"]) == 2
    assert "--max-restarts needs --gpus N" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rank_killed_once_is_restarted_and_the_run_resumes_and_finishes(qwen3_target, line_data, tmp_path):
    """--gpus 2 --max-restarts 1: SIGKILL to the target rank after a checkpoint; torchrun restarts the
    job, whose groups are made afresh (the job's store keeps the first start's keys) and which resumes."""
    from line_helpers import base_args, read_jsonl, start, wait_until

    out = tmp_path / "run"
    args = [*base_args(qwen3_target, line_data, out, epochs=4, save_every=2, trace=True), "--gpus", "2",
            "--max-restarts", "1"]
    proc = start(args)
    wait_until(lambda: len(list((out / "checkpoints").glob("step-*"))) >= 1, 180, "a checkpoint", proc)
    target = json.loads((out / "ranks" / "rank-1.json").read_text())
    assert target["role"] == "target"
    os.kill(target["pid"], signal.SIGKILL)
    out_text, err_text = proc.communicate(timeout=240)
    assert proc.returncode == 0, err_text[-4000:]
    starts = read_jsonl(out / "starts.jsonl")
    assert [s["mode"] for s in starts] == ["fresh", "restart"] and starts[1]["restart_count"] == 1
    assert starts[1]["step"] >= 2
    # Attempt 0's rank 0 stops on torchrun's SIGTERM and releases the run directory's lock, or is killed
    # and leaves it to be taken over (tests/pipeline/test_rundir.py): the restart owns the directory either
    # way, and releases it when it finishes.
    assert "belongs to a live run" not in err_text and not (out / "run.lock").exists()
    total = max(r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train")
    steps = read_jsonl(out / "trace" / "steps.jsonl")
    assert steps[-1]["step"] == total and (out / "final" / "model.safetensors").is_file()
    assert f"finished at step {total}" in out_text
