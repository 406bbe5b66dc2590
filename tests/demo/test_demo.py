"""The built-in demo, shortened (same code path, less data): it trains a drafter that beats none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from draftline.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # two slow cores take 10+ minutes


def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "draftline", "demo", "--quick", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for stage in ("regenerate", "prepare", "train", "eval", "report"):
        assert f"$ draftline {stage}" in result.stdout
    # It says what it trains, and the command trains that.
    assert "a DFlash drafter with the D-PACE loss" in result.stdout
    train = next(line for line in result.stdout.splitlines() if line.startswith("$ draftline train"))
    assert "--method dflash --loss dpace" in train
    summary = json.loads((out / "demo.json").read_text())
    # Without a drafter tau is exactly 1 (an untrained one starts at ~1.0); the issue asks this
    # shortened run to beat 1.5 (measured on 2 cores: README "Demo results").
    print(f"quick demo: tau {summary['tau']:.3f} in {summary['minutes']:.1f} min")
    assert summary["tau"] > 1.5, summary
    # The training monitor's final measurement decodes eval's prompts at eval's length (issue 14: within 10%).
    assert abs(summary["monitor_tau"] - summary["tau"]) <= 0.10 * summary["tau"], summary
    run = out / "run"
    assert (run / "final" / "model.safetensors").is_file()
    assert (run / "report" / "summary.md").is_file()
    per_prompt = json.loads((out / "eval.json").read_text())["per_prompt"]
    assert len(per_prompt) == 24 and all(sum(p["acceptance_lengths"]) > 0 for p in per_prompt)
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines()]
    # Two processes, each a target and a drafter; the drafters replicate (one gradient all-reduce per step).
    assert starts[-1]["topology"] == {"targets": 2, "drafters": 2, "colocated": True, "target_parallel": 1,
                                      "world_size": 2, "device": "cpu", "sharded": False, "replicated": True}
    # The demo's drafter leaves for the engines like any other: its feature layers are ones they capture.
    # (The command in this process: a process of its own would add only its ~4 s of imports.)
    assert main(["export", str(run), str(out / "export")]) == 0
    assert json.loads((out / "export" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 4]
