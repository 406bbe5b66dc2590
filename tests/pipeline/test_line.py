"""The training line end to end on CPU: one process, and separate gloo ranks under torchrun."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from draftline.cli import main
from draftline.checkpoint.export import load_drafter
from draftline.data.dataset import TokenDataset
from line_helpers import base_args, read_jsonl, run, step_losses

pytestmark = pytest.mark.slow


def _samples_by_epoch(run_dir):
    seen = Counter()
    for path in (run_dir / "trace").glob("drafter-*.jsonl"):
        for record in read_jsonl(path):
            for sid in record["sample_ids"]:
                seen[(record["epoch"], sid)] += 1
    return seen


@pytest.fixture(scope="module")
def colocated(qwen3_target, line_data, tmp_path_factory):
    """The reference: one process, target and drafter together."""
    out = tmp_path_factory.mktemp("colocated") / "run"
    args = base_args(qwen3_target, line_data, out, epochs=2, grad_accum=2, trace=True, save_every=2)
    assert main(["train", *args]) == 0
    return out


def test_colocated_run_writes_everything(colocated, line_data):
    losses = step_losses(colocated)
    assert len(losses) >= 5 and all(math.isfinite(v) for v in losses.values())
    final = load_drafter(colocated / "final")
    assert final.config.num_hidden_layers == 1 and final.config.block_size == 4
    records = read_jsonl(colocated / "metrics.jsonl")
    kinds = Counter(r["kind"] for r in records)
    assert kinds["start"] == 1 and kinds["end"] == 1 and kinds["train"] >= 1
    train = [r for r in records if r["kind"] == "train"][-1]
    total = train["total_steps"]
    assert train["step"] == total == max(losses) and total >= 7
    # Saved every 2 steps (--save-every 2) and at the end; the newest 3 kept (--keep 3).
    saved = sorted({*range(2, total, 2), total})
    assert [p.name for p in sorted((colocated / "checkpoints").glob("step-*"))] == [f"step-{s:08d}" for s in saved[-3:]]
    assert train["ktok_s"] > 0 and train["samples"] == 2 * len(TokenDataset(line_data))
    # One process: its target and drafter share the device, and the queue between them holds 2 batches (the default).
    assert train["q_hs_capacity"] == 2 and 0 <= train["q_hs"] <= 2
    assert all(0 <= q <= 8 for q in train["q_pre"]) and len(train["q_pre"]) == 1
    assert train["mfu"] is None and train["gpus"] == []  # CPU: no MFU, no device rows
    assert len(train["accuracy_by_position"]) == 3 and all(0 <= a <= 1 for a in train["accuracy_by_position"])
    assert math.isfinite(train["loss"]) and train["tf_acceptance"] >= 1 and train["epochs_done"] == 2.0
    assert records[-1]["status"] == "finished"
    starts = read_jsonl(colocated / "starts.jsonl")
    assert [s["mode"] for s in starts] == ["fresh"]
    # Every sample trained exactly once per epoch.
    n = len(TokenDataset(line_data))
    seen = _samples_by_epoch(colocated)
    assert set(seen.values()) == {1}
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(n)]


def test_learning_happens(qwen3_target, line_data, tmp_path):
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, epochs=6, lr="1e-2", trace=True, draft_layers=2)
    assert main(["train", *args]) == 0
    losses = list(step_losses(out).values())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("layout", [["--targets", "2"], ["--targets", "1"], ["--colocated"]],
                         ids=["2targets+1drafter", "1target+2drafters", "3colocated"])
def test_separate_ranks_match_the_single_process(colocated, qwen3_target, line_data, tmp_path, layout):
    """Every batch once per epoch on 3 processes. --grad-accum is per drafter: with 2 batches per
    step, as in the reference, the losses match it step for step (3 colocated ranks take 3)."""
    out = tmp_path / "run"
    drafters = 3 if layout == ["--colocated"] else 3 - int(layout[-1])
    args = base_args(qwen3_target, line_data, out, epochs=2, grad_accum=2 // drafters or 1, trace=True)
    result = run([*args, "--gpus", "3", *layout])
    assert result.returncode == 0, result.stderr[-4000:]
    assert set(_samples_by_epoch(out).values()) == {1}
    assert _samples_by_epoch(out).keys() == _samples_by_epoch(colocated).keys()
    traces = {int(p.stem.split("-")[1]): read_jsonl(p) for p in (out / "trace").glob("drafter-*.jsonl")}
    assert sorted(traces) == list(range(drafters))
    if drafters == 1 or drafters == 2:  # 2 batches per step, as in the reference: the same losses
        reference, losses = step_losses(colocated), step_losses(out)
        assert losses.keys() == reference.keys()
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    # The hidden-state queues: one over all targets (8 by default), or one per colocated rank (2 by default; the
    # status sums them).
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    capacity = 2 * 3 if layout == ["--colocated"] else 8
    assert train and all(r["q_hs_capacity"] == capacity and 0 <= r["q_hs"] <= capacity for r in train)
    # Nothing compiles while a CPU line trains: no window says it compiled, and the count does not move.
    assert all(r["compiling_s"] == 0.0 for r in train) and len({r["compile_s"] for r in train}) == 1
    if drafters > 1:  # every drafter trains its share of every step: they compute in parallel
        steps = [{r["step"] for r in records} for records in traces.values()]
        last = max(max(s) for s in steps)
        assert all(s >= set(range(last)) for s in steps), steps


def test_acceptance_is_measured_during_and_after_training(qwen3_target, line_data, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": list(range(i, i + 12))}) + "\n" for i in range(3)))
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, max_steps=4, eval_every=2, eval_prompts=prompts,
                     eval_max_new_tokens=8, eval_final_max_new_tokens=8)
    assert main(["train", *args]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4] and [bool(e.get("final")) for e in evals] == [False, True]
    for e in evals:
        hist, steps = e["acceptance_hist"], e["num_steps"]
        assert e["num_prompts"] == 3 and len(hist) == 4 and sum(hist) == steps > 0
        # tau is the mean committed length; slot k was accepted by the steps that committed more than k.
        assert e["tau"] == pytest.approx(sum((k + 1) * n for k, n in enumerate(hist)) / steps)
        assert e["acceptance_by_position"] == pytest.approx([sum(hist[k:]) / steps for k in range(1, 4)])
    # The monitor's tau is the latest measurement before its record (the final one comes after the last).
    last_train = [r for r in records if r["kind"] == "train"][-1]
    assert last_train["tau_step"] == 2 and last_train["tau"] == pytest.approx(evals[0]["tau"])


def test_passes_bound_the_dense_mask_and_keep_every_anchor():
    from draftline.data.batch import PackedBatch
    from draftline.objective.anchors import sample_anchors
    from draftline.objective.blocks import plan_passes

    docs = [(list(range(n)), [True] * n) for n in (200, 31, 150, 90, 400)]
    batch = PackedBatch.from_documents(docs)
    anchors = sample_anchors(batch, 40, seed=0)
    passes = plan_passes(batch, anchors, max_anchors_per_pass=64, block_size=8, max_dense_entries=200_000)
    covered = torch.cat([p.anchors + p.token_lo for p in passes])
    assert torch.equal(covered, anchors)  # every anchor once, in order
    for p in passes:
        rows = p.anchors.numel() * 8
        assert p.anchors.numel() <= 64
        assert p.anchors.numel() == 1 or rows * (p.batch.num_tokens + rows) <= 200_000
        assert p.batch.num_tokens == p.token_hi - p.token_lo
    assert len(plan_passes(batch, anchors, 10**6, 8)) == 1  # without a dense bound: one pass


def test_report_renders_from_a_real_run(colocated):
    assert main(["report", str(colocated)]) == 0
    report = colocated / "report"
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert {"loss.png", "throughput.png", "queues.png"} <= set(pngs)
    summary = (report / "summary.md").read_text()
    total = [r for r in read_jsonl(colocated / "metrics.jsonl") if r["kind"] == "train"][-1]["total_steps"]
    assert f"Status: **finished**, step {total} of {total}" in summary
    assert "- colocated: True" in summary and "- world_size: 1" in summary
    assert "| epochs trained | 2.00 of 2 |" in summary and "| GPU-hours | n/a (CPU run) |" in summary
    assert "Ktok/s (no MFU: CPU) |" in summary


def test_soft_labels_through_the_line_match_the_single_process(qwen3_target, line_data, tmp_path):
    """--distill: the target's final hidden state travels with the features (1 target + 1 drafter
    on gloo) and gives the same losses as one process; soft labels change the loss."""
    common = dict(max_steps=4, trace=True)
    single, line, hard = tmp_path / "single", tmp_path / "line", tmp_path / "hard"
    assert main(["train", *base_args(qwen3_target, line_data, single, distill=0.5, loss="dflash", **common)]) == 0
    result = run([*base_args(qwen3_target, line_data, line, distill=0.5, loss="dflash", **common), "--gpus", "2", "--targets", "1"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert main(["train", *base_args(qwen3_target, line_data, hard, **common)]) == 0
    reference, losses = step_losses(single), step_losses(line)
    assert len(reference) == 4 and losses.keys() == reference.keys()
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    # Soft labels change the loss from the same start.
    assert reference[1] != pytest.approx(step_losses(hard)[1], rel=1e-3)


# One target or two feeding two drafters is the same agreement among the drafters: two targets here.
@pytest.mark.parametrize("layout", [["--gpus", "2", "--colocated"], ["--gpus", "4", "--targets", "2"],
                                    ["--gpus", "4", "--targets", "2", "--target-parallel", "2"],
                                    ["--gpus", "2", "--colocated", "--target-parallel", "2"]],
                         ids=["2colocated", "2targets+2drafters", "group-of-2+2drafters", "2colocated-group-of-2"])
def test_a_time_limit_ends_the_training_early_and_finishes_the_run(qwen3_target, line_data, tmp_path, layout):
    """--max-minutes: the drafters agree on the step, the run finishes there (export, end record), exit 0; the
    learning rate follows the clock down its cosine (the steps alone, 400 epochs' worth, would leave it at its peak).
    Two drafters in every layout: each started its clock at its own moment, so one that followed its own would
    take another learning rate than its peer and end with other weights. With a target group (--target-parallel 2)
    its ranks, stopped mid-stream, end cleanly too."""
    out = tmp_path / "run"
    args = base_args(qwen3_target, line_data, out, epochs=400, max_minutes=0.04, save_every=100000, trace=True)
    result = run([*args, *layout])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    end, train = records[-1], [r for r in records if r["kind"] == "train"][-1]
    assert end["kind"] == "end" and end["status"] == "finished" and end["reason"] == "time limit"
    assert 0 < end["step"] < train["total_steps"] and end["elapsed_s"] < 60
    lrs = [r["lr"] for r in read_jsonl(out / "trace" / "steps.jsonl")]
    assert len(lrs) == end["step"] and lrs[0] == pytest.approx(3e-3) and lrs[-1] < 0.5 * 3e-3, lrs
    # Two drafters follow one clock, their mean in the step's record: the same learning rate, the same weights.
    sums = [{r["step"]: r["weights"] for r in read_jsonl(p)} for p in sorted((out / "trace").glob("drafter-*.jsonl"))]
    assert len(sums) == 2 and sums[0].keys() == sums[1].keys() and sums[0] == sums[1]
    assert load_drafter(out / "final").config.num_hidden_layers == 1
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert [p.name for p in saved] == [f"step-{end['step']:08d}"]  # the final checkpoint, at the agreed step


def test_a_run_with_an_fp8_target_trains_on_its_features(qwen3_target, line_data, tmp_path, capsys):
    first = {}
    for fp8 in (False, True):
        out = tmp_path / f"run-{fp8}"
        extra = {"max_steps": 2, "seed": 0, "trace": True} | ({"target_fp8": True} if fp8 else {})
        assert main(["train", *base_args(qwen3_target, line_data, out, **extra)]) == 0
        first[fp8] = min(step_losses(out).items())[1]
    assert "the target's linear layers in FP8 (--target-fp8)" in capsys.readouterr().out
    assert first[True] != first[False]  # the same seed and batches, other features
