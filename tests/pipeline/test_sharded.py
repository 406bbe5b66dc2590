"""Several drafters (CPU ranks, gloo), their state sharded (FSDP2) or replicated: they give the losses and
weights of one process, replicated drafters stay equal, and a run stopped on two drafters and resumed on
one, or on drafters holding their state the other way, ends where the run that never stopped ends.

The reference is a single process with the same batches per optimizer step (``--grad-accum``): the step is the
same sum over the same batches whatever the number of drafters, so the losses agree to fp32 rounding (the
sums run in another order) and the weights too.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest
from safetensors.torch import load_file

from draftline.checkpoint.state import latest_checkpoint
from draftline.cli import main
from line_helpers import base_args, one_thread, read_jsonl, run, start, step_losses, wait_until

pytestmark = pytest.mark.slow


def _args(target, data, out, **extra):
    return base_args(target, data, out, epochs=2, trace=True, random_init=True, token_budget=256, **extra)


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) >= 4
    for step, loss in a.items():
        assert b[step] == pytest.approx(loss, rel=1e-6), step


def _weights(checkpoint):
    return load_file(checkpoint / "drafter" / "model.safetensors")


def _weights_close(a, b) -> None:
    # Adam divides by the gradient's running RMS: where a gradient is near zero, the sums' other order moves a
    # weight by a small fraction of the learning rate (1.5e-5 of the tensor's largest weight was seen on one CPU,
    # 0.0005 lr); a lost or doubled shard moves weights by about lr per step (3e-3, 3e-2 of the largest).
    for name, value in a.items():
        scale = float(value.abs().max()) or 1.0
        assert float((value - b[name]).abs().max()) / scale < 1e-4, name


@pytest.fixture(scope="module")
def one_process(qwen3_target, line_data, tmp_path_factory):
    """One drafter, six batches per optimizer step (in this process)."""
    out = tmp_path_factory.mktemp("one") / "run"
    with one_thread():
        assert main(["train", *_args(qwen3_target, line_data, out, grad_accum=6)]) == 0
    return out


@pytest.mark.parametrize("layout", [["--gpus", "3", "--targets", "1", "--grad-accum", "3"],  # 2 drafters
                                    ["--gpus", "3", "--colocated", "--grad-accum", "2"]])  # 3 drafters, each beside a target
def test_sharded_drafters_give_the_losses_and_weights_of_one_process(one_process, qwen3_target, line_data, tmp_path,
                                                                      layout):
    out = tmp_path / "run"
    done = run([*_args(qwen3_target, line_data, out), *layout, "--drafter-state", "shard"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded over the" in done.stdout
    _close(step_losses(one_process), step_losses(out))
    _weights_close(_weights(latest_checkpoint(one_process)), _weights(latest_checkpoint(out)))
    shards = list((latest_checkpoint(out) / "state").glob("*.distcp"))
    assert len(shards) == (2 if "--targets" in layout else 3)  # each drafter wrote its own


def test_replicated_drafters_give_the_losses_and_weights_of_one_process_and_stay_equal(one_process, qwen3_target,
                                                                                        line_data, tmp_path):
    """On CPU several drafters replicate by default: each holds the whole drafter, the gradients are summed
    once per step. A drafter whose gradients were not summed, or summed twice, would leave one process's
    losses within a step or two."""
    out = tmp_path / "run"
    done = run([*_args(qwen3_target, line_data, out), "--gpus", "3", "--colocated", "--grad-accum", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replicated on the 3 drafters" in done.stdout
    _close(step_losses(one_process), step_losses(out))
    _weights_close(_weights(latest_checkpoint(one_process)), _weights(latest_checkpoint(out)))
    # Each drafter's trace: the sum of its weights as each of its batches began, equal on every drafter at
    # every step (to the bit: every drafter takes the same update on the same summed gradient).
    traces = [read_jsonl(p) for p in sorted((out / "trace").glob("drafter-*.jsonl"))]
    assert len(traces) == 3
    sums = [{r["step"]: r["weights"] for r in t} for t in traces]
    assert len(sums[0]) >= 4 and all(s == sums[0] for s in sums[1:])
    assert len(set(sums[0].values())) == len(sums[0])  # the weights did change from step to step


@pytest.mark.parametrize("states", [("replicate", None), ("shard", "replicate")])
def test_stopped_on_two_drafters_resumed_elsewhere_ends_like_the_run_that_never_stopped(one_process, qwen3_target,
                                                                                        line_data, tmp_path, capsys,
                                                                                        states):
    """Stopped on two drafters, replicated or sharded; resumed on one drafter, or on two holding their state the
    other way: the checkpoint's state loads whatever the drafters and their state."""
    stopped_state, resumed_state = states
    out = tmp_path / "run"
    two = [*_args(qwen3_target, line_data, out, grad_accum=3, save_every=1000), "--gpus", "2", "--colocated",
           "--drafter-state", stopped_state]
    proc = start(two)
    # Step 1's record is written during step 2 (one step late): stopped then, the run ends at step 2 or later,
    # before its last (6), also on a loaded machine (stopped after 2 records, one run reached step 6 first).
    wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 1, 180, "1 step", proc)
    ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank-*.json"))]
    # The ranks are held still while one drafter gets the signal, so that a fast machine does not run to the last
    # step before the stop is agreed (steps take ~0.1 s here; it did once).
    for rank in ranks:
        os.kill(rank["pid"], signal.SIGSTOP)
    os.kill(next(r for r in ranks if r["role_index"] == 1)["pid"], signal.SIGINT)  # one drafter: all agree on the step
    for rank in ranks:
        os.kill(rank["pid"], signal.SIGCONT)
    out_text, err_text = proc.communicate(timeout=180)
    assert proc.returncode == 0, err_text[-3000:]
    stopped_at = int(latest_checkpoint(out).name.split("-")[-1])
    reference = step_losses(one_process)
    assert 2 <= stopped_at < len(reference)

    again = [*_args(qwen3_target, line_data, out, grad_accum=3, save_every=1000), "--resume"]
    if resumed_state is None:  # one drafter, in this process
        capsys.readouterr()
        with one_thread():
            assert main(["train", *again]) == 0
        printed = capsys.readouterr().out
        assert "written by 2 drafter(s), resumed on 1: a step keeps its 6 batch(es), 6 per drafter" in printed
    else:
        resumed = run([*again, "--gpus", "2", "--colocated", "--drafter-state", resumed_state])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "replicated on the 2 drafters" in resumed.stdout
    _close(reference, step_losses(out))
    _weights_close(_weights(latest_checkpoint(one_process)), _weights(latest_checkpoint(out)))


def _resume_copy(checkpoint, out) -> None:
    """A run directory holding only ``checkpoint``: what a run stopped right after it leaves to --resume."""
    import shutil

    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    (out / "checkpoints" / "latest").write_text(checkpoint.name + "\n")


def test_resumed_on_more_drafters_with_uneven_shares_ends_like_the_run_that_never_stopped(qwen3_target, line_data,
                                                                                           tmp_path):
    """One drafter's checkpoint resumed on two, and two drafters' resumed on three: five batches a step, so the
    shares are uneven (3 + 2, then 2 + 2 + 1); each resumed run's per-step losses and final weights are those of
    the run that never stopped."""
    straight = tmp_path / "straight"
    args = lambda out: _args(qwen3_target, line_data, out, grad_accum=5, save_every=2, keep=10)  # noqa: E731
    assert main(["train", *args(straight)]) == 0
    reference = step_losses(straight)
    assert len(reference) >= 6
    straight_seqs = sorted(r["seq"] for r in read_jsonl(straight / "trace" / "drafter-0.jsonl"))

    on_two = tmp_path / "on-two"
    _resume_copy(straight / "checkpoints" / "step-00000002", on_two)
    done = run([*args(on_two), "--resume", "--gpus", "2", "--colocated"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written by 1 drafter(s), resumed on 2: a step keeps its 5 batch(es), 2.5 per drafter" in done.stdout

    on_three = tmp_path / "on-three"
    _resume_copy(on_two / "checkpoints" / "step-00000004", on_three)
    done = run([*args(on_three), "--resume", "--gpus", "3", "--colocated"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written by 2 drafter(s), resumed on 3: a step keeps its 5 batch(es)" in done.stdout

    for out, first in ((on_two, 3), (on_three, 5)):
        losses = step_losses(out)
        assert sorted(losses) == [s for s in sorted(reference) if s >= first], out.name
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=1e-6), (out.name, step)
        _weights_close(_weights(latest_checkpoint(straight)), _weights(latest_checkpoint(out)))
        # The batches after the checkpoint, each trained once, by drafters taking uneven shares of every step.
        seqs, shares = [], {}
        for path in (out / "trace").glob("drafter-*.jsonl"):
            for record in read_jsonl(path):
                seqs.append(record["seq"])
                shares.setdefault(record["step"], Counter())[path.name] += 1
        assert sorted(seqs) == [s for s in straight_seqs if s >= (first - 1) * 5], out.name
        expected = [3, 2] if out == on_two else [2, 2, 1]
        full = [step for step in shares if step < max(shares)]  # the last step may hold the data's last batches
        assert full and all(sorted(shares[step].values(), reverse=True) == expected for step in full), shares
