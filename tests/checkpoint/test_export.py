"""The z-lab checkpoint format: exact names, round trip, loads in the official code, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.cli import main
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config


@pytest.fixture()
def drafter(qwen3_target):
    config = build_drafter_config(
        load_target_config(qwen3_target), num_hidden_layers=2, block_size=8,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
    )
    torch.manual_seed(0)
    return DFlashDrafter(config).float()


def test_exact_tensor_names_and_config_fields(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "d")
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    per_layer = {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight",
    }
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == expected  # no embedding, no LM head, no "model." prefix
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 8 and config["num_target_layers"] == 8
    assert config["dflash_config"]["mask_token_id"] == 319
    assert config["dflash_config"]["target_layer_ids"] == [1, 5]
    assert config["max_position_embeddings"] == 512  # the target's
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 16 and config["use_sliding_window"] is True
    assert config["vocab_size"] == 320 and config["hidden_act"] == "silu" and config["attention_bias"] is False
    assert config["hidden_size"] == 64
    assert config["dtype"] == "bfloat16"


def test_round_trip_is_exact_in_fp32(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "d")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_official_save_pretrained_loads_as_warm_start(drafter, tmp_path):
    """A drafter saved by the official code (a released z-lab checkpoint) loads through our loader."""
    dflash_model = pytest.importorskip("dflash.model")
    save_drafter(drafter, tmp_path / "ours", dtype=torch.float32)
    official = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    official.save_pretrained(tmp_path / "released")
    loaded = load_drafter(tmp_path / "released")
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_missing_and_extra_tensors_are_named(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    path = tmp_path / "d" / "model.safetensors"
    tensors = load_file(path)
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["model.embed_tokens.weight"] = torch.zeros(320, 64)
    save_file(tensors, path)
    with pytest.raises(DraftlineError, match=r"missing \['layers.1.mlp.up_proj.weight'\].*unexpected \['model.embed_tokens.weight'\]"):
        load_drafter(tmp_path / "d")


def test_wrong_shape_and_bad_config_are_named(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    path = tmp_path / "d" / "model.safetensors"
    tensors = load_file(path)
    tensors["fc.weight"] = torch.zeros(64, 64)
    save_file(tensors, path)
    with pytest.raises(DraftlineError, match=r"fc.weight has shape \(64, 64\), the config needs \(64, 128\)"):
        load_drafter(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 10_000
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlineError, match="mask_token_id=10000 is outside"):
        load_drafter(tmp_path / "d")


def test_export_command_from_a_checkpoint_dir(drafter, qwen3_target, tmp_path, capsys):
    save_drafter(drafter, tmp_path / "run" / "checkpoints" / "step-00000010" / "drafter", dtype=torch.float32)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--target", str(qwen3_target)]) == 0
    loaded = load_drafter(tmp_path / "out")
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight.bfloat16().float())
    assert "num_speculative_tokens\": 7" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out2")]) == 2


def test_default_drafter_for_a_hybrid_target_loads_in_the_official_code(tmp_path):
    """A Qwen3.5-style target's default drafter (sliding x(n-1) + full, window 2048, whole-head rope) is
    written in a form the official DFlash loader takes, weights and layer types intact."""
    from helpers import make_qwen3_5_target

    dflash_model = pytest.importorskip("dflash.model")
    target = make_qwen3_5_target(tmp_path / "target")
    config = build_drafter_config(load_target_config(target), num_hidden_layers=3, block_size=16)
    torch.manual_seed(0)
    ours = DFlashDrafter(config).float()
    save_drafter(ours, tmp_path / "drafter", dtype=torch.float32)
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert saved["sliding_window"] == 2048 and saved["use_sliding_window"] is True
    assert "partial_rotary_factor" not in saved["rope_parameters"]
    assert saved["dflash_config"] == {"mask_token_id": 319, "target_layer_ids": [1, 3, 5]}
    official = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=torch.float32)
    assert list(official.config.layer_types) == saved["layer_types"] and official.config.sliding_window == 2048
    official_state = official.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(official_state[name], tensor)
