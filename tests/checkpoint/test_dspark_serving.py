"""The DSpark serving check: each rule refused with a drafter broken that way, named; good drafters pass."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline.checkpoint.dspark_serving import CONFIDENCE_OFF_WARNING, VLLM_GATED_WARNING
from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.serving import check_drafter_dir, inspect_drafter_dir
from draftline.errors import DraftlineError
from draftline.model.target import load_target_config
from helpers import make_dspark_drafter


def _save(target_dir, path, **options):
    drafter = make_dspark_drafter(load_target_config(target_dir), block_size=7, markov_rank=16, target_layer_ids=(1, 5),
                                  **options)
    return save_drafter(drafter, path, dtype=torch.float32)


@pytest.fixture(scope="module")
def good(qwen3_target, tmp_path_factory):
    return _save(qwen3_target, tmp_path_factory.mktemp("dspark_serving") / "good")


@pytest.fixture()
def broken(good, tmp_path):
    return shutil.copytree(good, tmp_path / "broken")


def edit_config(path, change):
    data = json.loads((path / "config.json").read_text())
    change(data)
    (path / "config.json").write_text(json.dumps(data))


def edit_tensors(path, change):
    tensors = load_file(path / "model.safetensors")
    save_file(change(tensors) or tensors, path / "model.safetensors")


def refusal(path, target) -> str:
    with pytest.raises(DraftlineError) as info:
        check_drafter_dir(path, target)
    return str(info.value)


def test_a_good_drafter_passes_without_warnings(good, qwen3_target):
    assert check_drafter_dir(good, qwen3_target) == []


def _put(name, value):
    return lambda data: data.update({name: value})


def _drop(name):
    return lambda data: data.pop(name)


@pytest.mark.parametrize("change,pattern", [
    (_put("architectures", ["DFlashDraftModel"]),
     "architectures: is ['DFlashDraftModel']; vLLM 0.33.0 picks the dspark"),
    (_put("model_type", "llama"), "model_type: is 'llama'"),
    (_put("block_size", 0), "block_size: is 0"),
    (_drop("mask_token_id"), "mask_token_id: is None; SGLang 0.5.23 refuses"),
    (_put("mask_token_id", 320), "mask_token_id: is 320, outside the target's vocabulary [0, 320)"),
    (_put("dflash_config", {"mask_token_id": 319, "target_layer_ids": [1, 5]}), "dflash_config: is present"),
    (_put("speculators_model_type", "dspark"), "speculators_model_type: is 'dspark'"),
    (_put("sample_from_anchor", False), "sample_from_anchor: is False"),
    (_put("markov_rank", 0), "markov_rank: is 0; SGLang 0.5.23 refuses"),
    (_put("markov_head_type", "rnn"), "markov_head_type: is 'rnn'"),
    (_put("enable_confidence_head", "yes"), "enable_confidence_head: is 'yes'"),
    (_drop("confidence_head_with_markov"), "confidence_head_with_markov: missing: SGLang 0.5.23 then reads"),
    (_put("target_layer_ids", [5, 1]), "target_layer_ids: [5, 1] is not strictly increasing"),
    (_put("target_layer_ids", [1, 7]), "target_layer_ids: [1, 7] holds 7, the target's last layer"),
    (_put("is_causal", True), "is_causal: is True"),
    (_put("hidden_size", 32), "hidden_size: is 32, the target's is 64"),
    (_put("draft_vocab_size", 100), "draft_vocab_size: is 100"),
])
def test_config_rules(broken, qwen3_target, change, pattern):
    edit_config(broken, change)
    assert pattern in refusal(broken, qwen3_target)


def _gate(tensors):
    tensors["markov_head.gate_proj.weight"] = torch.zeros(16, 80)


def _no_confidence(tensors):
    del tensors["confidence_head.proj.bias"]


def _w2_shape(tensors):
    tensors["markov_head.markov_w2.weight"] = torch.zeros(320, 8)


def _embed(tensors):
    tensors["embed_tokens.weight"] = torch.zeros(320, 64)


def _prefix(tensors):
    return {"model." + name: t for name, t in tensors.items()}


def _no_layer_norm(tensors):
    del tensors["layers.1.input_layernorm.weight"]


@pytest.mark.parametrize("change,pattern", [
    (_gate, "markov_head.gate_proj.weight: 1 tensor(s) no engine maps"),
    (_no_confidence, "confidence_head.proj.bias: 1 tensor(s) the engines map are missing"),
    (_w2_shape, "markov_head.markov_w2.weight: has shape (320, 8), the config needs (320, 16)"),
    (_embed, "embed_tokens.weight: a drafter borrows the target's embedding"),
    (_prefix, "has a 'model.' prefix"),
    (_no_layer_norm, "layers.1.input_layernorm.weight: 1 tensor(s) the engines map are missing"),
])
def test_tensor_rules(broken, qwen3_target, change, pattern):
    edit_tensors(broken, change)
    assert pattern in refusal(broken, qwen3_target)


def test_a_confidence_head_size_follows_its_markov_input(broken, qwen3_target):
    edit_config(broken, _put("confidence_head_with_markov", False))
    assert "confidence_head.proj.weight: has shape (1, 80), the config needs (1, 64)" in refusal(broken, qwen3_target)


def test_a_gated_drafter_is_refused_for_vllm_only(qwen3_target, tmp_path):
    path = _save(qwen3_target, tmp_path / "gated", markov_head_type="gated")
    check = inspect_drafter_dir(path, qwen3_target)
    assert check.refused() == []  # SGLang serves it: the export goes ahead
    (vllm,) = check.refused(kinds=("vllm",))
    assert vllm.subject == "markov_head_type" and "builds the vanilla head only" in vllm.problem
    assert check.warnings == [VLLM_GATED_WARNING]
    edit_config(path, _put("markov_head_type", "vanilla"))  # a gated drafter said to be vanilla: its gate is named
    assert "markov_head.gate_proj.bias, markov_head.gate_proj.weight: 2 tensor(s) no engine maps" in refusal(
        path, qwen3_target)


def test_a_drafter_without_a_confidence_head_passes_with_a_warning(qwen3_target, tmp_path):
    path = _save(qwen3_target, tmp_path / "plain", confidence_head=False)
    assert check_drafter_dir(path, qwen3_target) == [CONFIDENCE_OFF_WARNING]
