"""A third-party consumer of the format: vllm-project/speculators' DFlash converter (the package, 0.9.0).

It turns a z-lab-format drafter into a speculators checkpoint for vLLM. An exported drafter must
convert with every tensor intact and the DFlash settings carried over; what the serving check
refuses for the last target layer, a ``model.`` prefix or a missing tensor, the converter fails on too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline.cli import main
from draftline.checkpoint.export import save_drafter
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config

converter = pytest.importorskip("speculators.convert.dflash.converter", reason="the test extra installs speculators")


def _drafter(target_dir, path, *, target_layer_ids=None):
    config = build_drafter_config(load_target_config(target_dir), num_hidden_layers=2, block_size=8,
                                  layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                                  target_layer_ids=target_layer_ids)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(config).float(), path, dtype=torch.float32)


def test_an_exported_drafter_converts_with_no_tensor_lost(qwen3_target, tmp_path):
    _drafter(qwen3_target, tmp_path / "final")
    assert main(["export", str(tmp_path / "final"), str(tmp_path / "out"), "--target", str(qwen3_target),
                 "--dtype", "float32"]) == 0
    converter.DFlashConverter().convert(tmp_path / "out", tmp_path / "converted", base_model=str(qwen3_target),
                                        validate=True)

    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(tmp_path / "converted" / "model.safetensors")
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2, 6]  # target_layer_ids [1, 5] + 1: vLLM's capture points
    assert config["block_size"] == 8 and config["mask_token_id"] == 319 and config["draft_vocab_size"] == 320
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7  # block_size - 1
    layer = config["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention", "full_attention"] and layer["sliding_window"] == 16
    assert layer["use_sliding_window"] is True and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == 64


def test_the_target_s_last_layer_loses_a_feature_in_the_converter(qwen3_target, tmp_path):
    """The serving check refuses target_layer_ids holding L-1; the converter drops it and fc no longer fits."""
    _drafter(qwen3_target, tmp_path / "d", target_layer_ids=[1, 7])
    with pytest.raises(RuntimeError, match=r"size mismatch for fc\.weight"):
        converter.DFlashConverter().convert(tmp_path / "d", tmp_path / "c", base_model=str(qwen3_target))


@pytest.mark.parametrize("change,error", [
    (lambda t: {"model." + k: v for k, v in t.items()}, "Unexpected keys in checkpoint"),
    (lambda t: {k: v for k, v in t.items() if k != "layers.0.self_attn.q_norm.weight"}, "Draft weights missing"),
])
def test_what_the_check_refuses_the_converter_refuses(qwen3_target, tmp_path, change, error):
    path = _drafter(qwen3_target, tmp_path / "d")
    save_file(change(load_file(path / "model.safetensors")), path / "model.safetensors")
    with pytest.raises(ValueError, match=error):
        converter.DFlashConverter().convert(path, tmp_path / "c", base_model=str(qwen3_target))
