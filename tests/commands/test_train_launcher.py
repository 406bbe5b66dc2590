"""``train`` launches for --gpus or a config file's topology.gpus, and restarts with --max-restarts."""

from __future__ import annotations

import json
import os
import signal

import pytest

def test_topology_gpus_in_a_config_file_launches_like_the_flag(tmp_path, monkeypatch):
    from draftline.cli import main
    from draftline.distributed import launch

    launched = []
    monkeypatch.setattr(launch, "launch", lambda gpus, restarts, argv, out, device: launched.append(
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
    monkeypatch.setattr(launch, "die_with_launcher", lambda: None)
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
    # and leaves it to be taken over (tests/distributed/test_rundir.py): the restart owns the directory either
    # way, and releases it when it finishes.
    assert "belongs to a live run" not in err_text and not (out / "run.lock").exists()
    total = max(r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "train")
    steps = read_jsonl(out / "trace" / "steps.jsonl")
    assert steps[-1]["step"] == total and (out / "final" / "model.safetensors").is_file()
    assert f"finished at step {total}" in out_text
