"""``draftline export``: the serving check on what it writes, the model card, and refusals that write nothing."""

from __future__ import annotations

import json

import torch

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.checkpoint.serving import check_drafter_dir
from draftline.cli import main
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config


def drafter_for(target_dir, *, layer_types=("sliding_attention", "full_attention"), target_layer_ids=None):
    config = build_drafter_config(load_target_config(target_dir), num_hidden_layers=2, block_size=8,
                                  layer_types=list(layer_types), sliding_window=16, target_layer_ids=target_layer_ids)
    torch.manual_seed(0)
    return DFlashDrafter(config).float()


def make_run(root, target_dir, **kw):
    """A run directory as training leaves it: config.json naming the target, final/ holding the drafter."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model": {"target": str(target_dir)}, "optim": {"lr": 1e-3}}))
    save_drafter(drafter_for(target_dir, **kw), root / "final", dtype=torch.float32)
    return root


def test_export_checks_against_the_run_s_target_and_writes_a_model_card(qwen3_target, tmp_path, capsys):
    run = make_run(tmp_path / "run", qwen3_target)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0  # the target comes from run/config.json
    printed = capsys.readouterr().out
    assert f"checked against the target {qwen3_target}" in printed and "VLLM_USE_V2_MODEL_RUNNER=1" in printed

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert len(check_drafter_dir(out, qwen3_target)) == 1  # what was written passes (the mixed-layers warning)
    card = (out / "README.md").read_text()  # its commands run: tests/checkpoint/test_model_card.py
    assert "SGLang (read: 0.5.23)" in card and "vLLM (read: 0.33.0)" in card
    assert f"TARGET=/path/to/{qwen3_target.name}\n" in card
    assert "target layers [1, 5] of 8; mask token id 319" in card
    assert "1 x sliding_attention, 1 x full_attention, window 16" in card


def test_a_drafter_of_full_attention_layers_needs_no_runner_flag(qwen3_target, tmp_path, capsys):
    run = make_run(tmp_path / "run", qwen3_target, layer_types=("full_attention", "full_attention"))
    assert main(["export", str(run / "final"), str(tmp_path / "out"), "--target", str(qwen3_target)]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in card and '\nvllm serve "$TARGET"' in card
    assert "warning" not in capsys.readouterr().out


def test_export_refuses_what_an_engine_would_load_wrongly_and_writes_nothing(qwen3_target, tmp_path, capsys):
    run = make_run(tmp_path / "run", qwen3_target, target_layer_ids=[1, 7])  # 7: the target's last layer
    out = tmp_path / "out"
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out}: vLLM 0.33.0 and SGLang 0.5.23 would not load this drafter" in err
    assert "[1, 7] holds 7, the target's last layer" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary left either

    # An existing export stays as it was.
    good = make_run(tmp_path / "good", qwen3_target)
    assert main(["export", str(good), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", str(run), str(out)]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_export_refuses_a_drafter_for_another_target(qwen3_target, llama_target, tmp_path, capsys):
    run = make_run(tmp_path / "run", qwen3_target)
    assert main(["export", str(run), str(tmp_path / "out"), "--target", str(llama_target)]) == 2
    err = capsys.readouterr().err
    assert "hidden_size: is 64, the target's is 48" in err and "vocab_size: is 320, the target's is 300" in err
    assert not (tmp_path / "out").exists()


def test_export_needs_a_target(qwen3_target, tmp_path, capsys):
    save_drafter(drafter_for(qwen3_target), tmp_path / "drafter", dtype=torch.float32)
    assert main(["export", str(tmp_path / "drafter"), str(tmp_path / "out")]) == 2
    assert "pass --target DIR" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "drafter"), str(tmp_path / "out"), "--target", str(tmp_path / "nope")]) == 2
    assert "is not a model directory here" in capsys.readouterr().err


def test_the_exported_weights_are_the_drafter_s(qwen3_target, tmp_path):
    run = make_run(tmp_path / "run", qwen3_target)
    assert main(["export", str(run), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    ours, exported = load_drafter(run / "final"), load_drafter(tmp_path / "out")
    for name, tensor in ours.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_eval_warns_about_what_only_the_engines_would_load_differently(qwen3_target, tmp_path, capsys):
    """eval decodes the drafter as draftline trained it, so a serving-only problem is said, not refused."""
    run = make_run(tmp_path / "run", qwen3_target, target_layer_ids=[1, 7])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    assert main(["eval", "--target", str(qwen3_target), "--drafter", str(run), "--prompts", str(prompts),
                 "--max-new-tokens", "3", "--stop-token-ids", "none"]) == 0
    out = capsys.readouterr().out
    assert "warning: vLLM/SGLang would not serve this drafter as evaluated (export refuses it)" in out
    assert "holds 7, the target's last layer" in out and "VLLM_USE_V2_MODEL_RUNNER=1" in out


def test_eval_refuses_a_drafter_trained_for_a_target_of_another_depth(qwen3_target, tmp_path, capsys):
    deeper = load_target_config(qwen3_target)
    deeper.num_hidden_layers = 10  # same hidden size and vocabulary: only the depth tells
    config = build_drafter_config(deeper, num_hidden_layers=2, block_size=8, target_layer_ids=[1, 5])
    save_drafter(DFlashDrafter(config).float(), tmp_path / "drafter", dtype=torch.float32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    assert main(["eval", "--target", str(qwen3_target), "--drafter", str(tmp_path / "drafter"),
                 "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "num_target_layers: is 10: the drafter was trained for a target of 10 layers, this one has 8" in err
