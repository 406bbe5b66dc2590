"""DSpark through the training line on CPU: the layouts give one process's losses and weights, a resume ends where
the straight run ends, the measurements during training, the monitor's records, the report, and a trained drafter
exported, loaded back, decoded losslessly and measured by ``draftline eval``.

The reference is one process with two batches per optimizer step; the other layouts take the same two batches a
step (--grad-accum is per drafter), so each step is the same sum over the same batches and the losses agree to fp32
rounding, as for DFlash (test_line.py, test_sharded.py). Sharded, the heads are FSDP2 units of their own
(tests/distributed/test_shard.py checks the units); replicated, each drafter holds them whole.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftline.checkpoint.export import load_drafter
from draftline.checkpoint.state import latest_checkpoint
from draftline.cli import main
from draftline.evaluate.speculative import speculative_generate, target_generate
from draftline.methods import method_for
from line_helpers import base_args, read_jsonl, run, step_losses

pytestmark = pytest.mark.slow

BLOCK = 4
PROMPTS = [list(range(i, i + 12)) for i in range(3)]


def _args(target, data, out, **extra):
    return base_args(target, data, out, epochs=2, trace=True, random_init=True, token_budget=256, method="dspark",
                     markov_rank=16, **extra)


def _weights(run_dir):
    return load_file(latest_checkpoint(run_dir) / "drafter" / "model.safetensors")


def _weights_close(a, b) -> None:
    assert a.keys() == b.keys() and any(name.startswith("markov_head.") for name in a)
    for name, value in a.items():  # fp32 sums in another order (test_sharded.py: what a lost shard would move)
        scale = float(value.abs().max()) or 1.0
        assert float((value - b[name]).abs().max()) / scale < 1e-4, name


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def one_process(qwen3_target, line_data, prompts_file, tmp_path_factory):
    """One process, two batches per step, a checkpoint every 2 steps (all kept), tau measured every 4 steps."""
    out = tmp_path_factory.mktemp("dspark") / "run"
    args = _args(qwen3_target, line_data, out, grad_accum=2, save_every=2, keep=20, eval_every=4,
                 eval_prompts=prompts_file, eval_max_new_tokens=8, eval_final_max_new_tokens=12)
    assert main(["train", *args]) == 0
    return out


@pytest.mark.parametrize("layout", [["--gpus", "2", "--colocated"],
                                    ["--gpus", "3", "--targets", "1", "--drafter-state", "shard"]],
                         ids=["2colocated-replicated", "1target+2drafters-sharded"])
def test_the_layouts_give_one_process_s_losses_and_weights(one_process, qwen3_target, line_data, tmp_path, layout):
    out = tmp_path / "run"
    done = run([*_args(qwen3_target, line_data, out), *layout])
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("sharded over the 2 drafters" if "shard" in layout else "replicated on the 2 drafters") in done.stdout
    assert "method: DSpark: vanilla Markov head of rank 16" in done.stdout
    reference, losses = step_losses(one_process), step_losses(out)
    assert losses.keys() == reference.keys() and len(reference) >= 8
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), step
    _weights_close(_weights(one_process), _weights(out))


def test_a_resume_ends_where_the_straight_run_ends(one_process, qwen3_target, line_data, tmp_path, capsys):
    """The run resumed from its step-4 checkpoint (a copy of the run directory holding only it) trains the same
    steps 5.. and ends with the same weights."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(one_process / "checkpoints" / "step-00000004", out / "checkpoints" / "step-00000004")
    (out / "checkpoints" / "latest").write_text("step-00000004\n")
    assert main(["train", *_args(qwen3_target, line_data, out, grad_accum=2), "--resume"]) == 0
    reference, losses = step_losses(one_process), step_losses(out)
    assert sorted(losses) == [s for s in sorted(reference) if s > 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), step
    _weights_close(_weights(one_process), _weights(out))
    # Resumed onto the other method, or other heads: refused, naming the flags to resume with.
    common = base_args(qwen3_target, line_data, out, epochs=2, random_init=True, token_budget=256, grad_accum=2)
    capsys.readouterr()
    for change, fix in ((["--method", "dflash"], "resume with --method dspark --markov-rank 16 --markov-head-type "
                                                 "vanilla --confidence-head --confidence-with-markov"),
                        (["--method", "dspark", "--markov-rank", "8"], "resume with --markov-rank 16,")):
        assert main(["train", *common, *change, "--resume"]) == 2
        assert fix in capsys.readouterr().err


def test_the_records_carry_dspark_s_terms_and_its_measured_acceptance(one_process):
    records = read_jsonl(one_process / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"][-1]
    # Every slot drafts: B accuracies, confidences and expected acceptances.
    for key in ("accuracy_by_position", "confidence_by_position", "expected_acceptance_by_position"):
        assert len(train[key]) == BLOCK and all(0 <= v <= 1 for v in train[key]), key
    for key in ("ce", "l1", "confidence_bce", "confidence_abs_error"):
        assert math.isfinite(train[key]) and train[key] >= 0, key
    assert 0 < train["l1"] <= 2 and 1 <= train["tau_expected"] <= BLOCK + 1
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals][-1] == train["total_steps"] and evals[-1]["final"] and len(evals) >= 3
    for e in evals:  # lengths up to B + 1: the anchor's slot drafts too
        hist, steps = e["acceptance_hist"], e["num_steps"]
        assert e["block_size"] == BLOCK + 1 and len(hist) == BLOCK + 1 and sum(hist) == steps > 0
        assert e["acceptance_by_position"] == pytest.approx([sum(hist[k:]) / steps for k in range(1, BLOCK + 1)])
        calibration = e["confidence_calibration"]
        assert len(calibration["predicted"]) == BLOCK and calibration["steps"][0] == steps
        assert calibration["realised"][0] == pytest.approx(e["acceptance_by_position"][0])
    assert main(["report", str(one_process)]) == 0
    assert (one_process / "report" / "confidence_calibration.png").is_file()
    assert (one_process / "report" / "method_loss.png").is_file()
    assert "## Confidence head" in (one_process / "report" / "summary.md").read_text()


def test_an_exported_drafter_decodes_losslessly_and_eval_reports_its_slots(one_process, qwen3_target, prompts_file,
                                                                        tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    assert main(["export", str(one_process), str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    drafter = load_drafter(out)
    method = method_for(drafter.config)
    assert method.name == "dspark"
    target = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    proposer = method.proposer(drafter.eval(), target)
    for prompt in PROMPTS:
        ours = speculative_generate(target, proposer, prompt, max_new_tokens=20)
        assert ours.output_ids == target_generate(target, prompt, max_new_tokens=20).output_ids
        assert max(ours.acceptance_lengths) <= BLOCK + 1 and len(ours.confidences) == len(ours.acceptance_lengths)

    report = tmp_path / "eval.json"
    assert main(["eval", "--target", str(qwen3_target), "--drafter", str(out), "--prompts", str(prompts_file),
                 "--max-new-tokens", "16", "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    lengths = [n for p in result["per_prompt"] for n in p["acceptance_lengths"]]
    assert result["block_size"] == BLOCK + 1 and len(result["acceptance_hist"]) == BLOCK + 1
    assert result["tau"] == pytest.approx(sum(lengths) / len(lengths)) and max(lengths) <= BLOCK + 1
    assert len(result["acceptance_by_position"]) == BLOCK
    assert all(len(p["confidences"]) == len(p["acceptance_lengths"]) for p in result["per_prompt"])
    assert len(result["confidence_calibration"]["predicted"]) == BLOCK
    assert "confidence head, predicted/realised acceptance" in capsys.readouterr().out
    assert main(["eval", "--target", str(qwen3_target), "--drafter", str(out), "--prompts", str(prompts_file),
                 "--block-size", "3"]) == 2


@pytest.mark.gpu
@pytest.mark.timeout(600, method="thread")
def test_gpu_dspark_trains_compiled_in_bf16(qwen3_target, line_data, prompts_file, tmp_path):
    """On CUDA: the line's default path (compiled drafter, bf16 autocast, flex attention, preflight) trains a DSpark
    drafter and measures it during training."""
    out = tmp_path / "compiled"
    done = run([*_args(qwen3_target, line_data, out, max_steps=6, eval_every=3, eval_prompts=prompts_file,
                       eval_max_new_tokens=8, eval_final_max_new_tokens=8), "--device", "cuda"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = step_losses(out)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses.values())
    records = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all(e["block_size"] == BLOCK + 1 for e in evals)
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["compile_s"] > 0  # the compiled drafter's compilations are counted


@pytest.mark.gpu
@pytest.mark.timeout(600, method="thread")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the sharded comparison needs 2 GPUs")
def test_gpu_dspark_sharded_over_two_gpus_trains_as_on_one(qwen3_target, line_data, tmp_path):
    """Two colocated drafters sharding a DSpark drafter (FSDP2 over NCCL, each head its own unit) give one GPU's
    losses (fp32, eager: equal to rounding)."""
    exact = ["--device", "cuda", "--dtype", "float32", "--no-compile", "--max-steps", "6"]
    one, two = tmp_path / "one", tmp_path / "two"
    done = run([*_args(qwen3_target, line_data, one, grad_accum=2), *exact], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    done = run([*_args(qwen3_target, line_data, two), *exact, "--gpus", "2", "--colocated", "--drafter-state", "shard"],
               timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sharded over the 2 drafters" in done.stdout
    reference = step_losses(one)
    assert step_losses(two).keys() == reference.keys()
    for step, loss in reference.items():
        assert step_losses(two)[step] == pytest.approx(loss, rel=1e-4), step


def test_the_dpace_loss_trains_and_a_resume_keeps_it(qwen3_target, line_data, tmp_path, capsys):
    """--method dspark --loss dpace trains through the line, its records carrying DSpark's terms; a resume that would
    weigh the loss otherwise (the default: DSpark's position weights) is refused, naming the flag that continues."""
    out = tmp_path / "run"
    args = _args(qwen3_target, line_data, out, max_steps=3, save_every=3)
    assert main(["train", *args, "--loss", "dpace"]) == 0
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train" and r["loss"] is not None]
    assert train and train[-1]["step"] == 3
    for key in ("loss", "ce", "l1", "confidence_bce", "tau_expected"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert json.loads((out / "config.json").read_text())["optim"]["loss"] == "dpace"
    for change in ([], ["--loss", "dflash"]):
        capsys.readouterr()
        assert main(["train", *args, *change, "--resume"]) == 2
        err = capsys.readouterr().err
        assert "trained with the dpace loss weights (optim.loss), this run asks for dflash: resume with --loss dpace" in err
