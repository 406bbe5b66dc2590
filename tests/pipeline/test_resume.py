"""Resume is exact; the run directory says what it holds; starting over needs a flag."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from draftline.cli import main
from draftline.checkpoint.state import latest_checkpoint
from line_helpers import base_args, read_jsonl, run, start, step_losses, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(qwen3_target, line_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert main(["train", *base_args(qwen3_target, line_data, out, epochs=3, trace=True)]) == 0
    return out


def test_stop_then_resume_equals_the_uninterrupted_run(uninterrupted, qwen3_target, line_data, tmp_path):
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, epochs=3, trace=True, save_every=1000)
    proc = start(args)
    wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 4, 120, "4 steps", proc)
    proc.send_signal(signal.SIGINT)  # a clean stop: checkpoint at the next step boundary
    out_text, err_text = proc.communicate(timeout=120)
    assert proc.returncode == 0, err_text[-3000:]
    assert "stopped at step" in out_text and "Traceback" not in err_text
    stopped_at = int(latest_checkpoint(out).name.split("-")[-1])
    reference = step_losses(uninterrupted)
    assert 4 <= stopped_at < len(reference)

    assert main(["train", *args, "--resume"]) == 0
    resumed = step_losses(out)
    assert resumed.keys() == reference.keys()
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6, abs=1e-9), step
    # No sample trained twice or skipped: each (epoch, sample) exactly once over both starts,
    # counting only batches of steps that reached a checkpoint before the stop.
    seen = {}
    for record in read_jsonl(out / "trace" / "drafter-0.jsonl"):
        key_set = [(record["epoch"], s) for s in record["sample_ids"]]
        for key in key_set:
            seen.setdefault(key, []).append(record["step"])
    duplicates = {k: v for k, v in seen.items() if len(v) > 1}
    # Batches of the step in flight at the stop were re-trained after the resume; nothing else.
    assert all(steps == [steps[0]] * len(steps) and steps[0] >= stopped_at for steps in duplicates.values())
    starts = read_jsonl(out / "starts.jsonl")
    assert [s["mode"] for s in starts] == ["fresh", "resume"] and starts[1]["step"] == stopped_at
    # Optimizer state survived in fp32 (the checkpoint's state/ as torch.distributed.checkpoint describes it).
    from torch.distributed.checkpoint import FileSystemReader

    described = FileSystemReader(str(latest_checkpoint(out) / "state")).read_metadata().state_dict_metadata
    moments = [m.properties.dtype for key, m in described.items() if key.endswith("exp_avg_sq")]
    assert moments and all(dtype == torch.float32 for dtype in moments)


def test_run_directory_guards(qwen3_target, line_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, max_steps=2)
    assert main(["train", *args, "--resume"]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert main(["train", *args]) == 0
    assert main(["train", *args]) == 2
    assert "pass --resume to continue it or --from-scratch" in capsys.readouterr().err
    assert main(["train", *args, "--from-scratch"]) == 0
    moved = list(out.glob("previous-*"))
    assert len(moved) == 1 and (moved[0] / "checkpoints").is_dir()
    assert [s["mode"] for s in read_jsonl(out / "starts.jsonl")] == ["fresh", "fresh"]
    assert main(["train", *args, "--resume", "--from-scratch"]) == 2


@pytest.fixture(scope="module")
def uninterrupted_two_batches(qwen3_target, line_data, tmp_path_factory):
    """The run never stopped, in one process with two batches a step: the step of two drafters with one batch each
    (the same sum over the same batches; test_line.py and test_sharded.py hold the line to one process's losses)."""
    out = tmp_path_factory.mktemp("uninterrupted-two") / "run"
    assert main(["train", *base_args(qwen3_target, line_data, out, epochs=3, grad_accum=2, trace=True)]) == 0
    return out


def test_a_stop_asked_of_one_rank_is_agreed_by_all_and_the_resume_equals_the_uninterrupted_run(
        uninterrupted_two_batches, qwen3_target, line_data, tmp_path):
    """Two separate drafter ranks (and a target rank) under torchrun. SIGINT reaches one drafter only;
    the ranks agree on the step through the step's all-reduced record (read one step late), the
    checkpoint is that step, and the resumed run's losses equal those of a run never stopped."""
    args = ["--gpus", "3", "--targets", "1"]
    reference = step_losses(uninterrupted_two_batches)

    out = tmp_path / "run"
    run_args = [*base_args(qwen3_target, line_data, out, epochs=3, trace=True, save_every=1000), *args]
    proc = start(run_args)
    wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 3, 180, "3 steps", proc)
    ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank-*.json"))]
    drafter = next(r for r in ranks if r.get("role") == "drafter" and r.get("role_index") == 1)
    os.kill(drafter["pid"], signal.SIGINT)  # the second drafter only
    out_text, err_text = proc.communicate(timeout=180)
    assert proc.returncode == 0, err_text[-3000:]
    assert "stopped at step" in out_text
    stopped_at = int(latest_checkpoint(out).name.split("-")[-1])
    assert 3 <= stopped_at < len(reference)

    resumed = run([*run_args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = step_losses(out)
    assert losses.keys() == reference.keys()
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-9), step
