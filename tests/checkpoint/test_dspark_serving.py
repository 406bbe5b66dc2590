"""The DSpark serving check: every ``dspark.*`` rule met by a drafter broken that way and named; the backbone's
rules read on the top-level fields; good drafters pass.

``BROKEN`` holds, for each DSpark rule id, the drafters broken for it; ``test_every_dspark_rule_has_a_drafter_broken
_that_way`` checks that every ``dspark.*`` id of ``RULES`` has one (tests/checkpoint/test_serving.py covers the rest).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.serving import RULES, check_drafter_config, check_drafter_dir, inspect_drafter_dir
from draftline.checkpoint.serving.dspark_rules import CONFIDENCE_OFF_WARNING, VLLM_GATED_WARNING
from draftline.errors import DraftlineError
from draftline.model.target import load_target_config
from helpers import edit_config, edit_tensors, make_dspark_drafter

WARNING_RULES = {"dspark.confidence_head_off"}
VLLM_ONLY = {"dspark.markov_head_type.vllm"}


def _save(target_dir, path, **options):
    drafter = make_dspark_drafter(load_target_config(target_dir), block_size=7, markov_rank=16, target_layer_ids=(1, 5),
                                  **options)
    return save_drafter(drafter, path, dtype=torch.float32)


@pytest.fixture(scope="module")
def good(qwen3_target, tmp_path_factory):
    return _save(qwen3_target, tmp_path_factory.mktemp("dspark_serving") / "good")


@pytest.fixture(scope="module")
def gated(qwen3_target, tmp_path_factory):
    return _save(qwen3_target, tmp_path_factory.mktemp("dspark_serving") / "gated", markov_head_type="gated")


@pytest.fixture(scope="module")
def plain(qwen3_target, tmp_path_factory):
    return _save(qwen3_target, tmp_path_factory.mktemp("dspark_serving") / "plain", confidence_head=False)


@pytest.fixture()
def broken(good, tmp_path):
    return shutil.copytree(good, tmp_path / "broken")


def refusal(path, target) -> str:
    with pytest.raises(DraftlineError) as info:
        check_drafter_dir(path, target)
    return str(info.value)


def _put(name, value):
    return lambda data: data.update({name: value})


def _drop(name):
    return lambda data: data.pop(name)


# ---- each DSpark rule: (the drafter to start from, the change, what the finding or warning says)
BROKEN = {
    "dspark.architectures": [("good", _put("architectures", ["Qwen3ForCausalLM"]),
                              "architectures: is ['Qwen3ForCausalLM']; vLLM 0.33.0 picks the dspark")],
    "dspark.block_size": [("good", _put("block_size", 0), "block_size: is 0"),
                          ("good", _put("block_size", True), "block_size: is True")],
    "dspark.mask_token_id": [("good", _drop("mask_token_id"), "mask_token_id: is None; SGLang 0.5.23 refuses")],
    "dspark.dflash_config": [("good", _put("dflash_config", {"mask_token_id": 319, "target_layer_ids": [1, 5]}),
                              "dflash_config: is present")],
    "dspark.speculators_model_type": [("good", _put("speculators_model_type", "dspark"),
                                       "speculators_model_type: is 'dspark'")],
    "dspark.sample_from_anchor": [("good", _put("sample_from_anchor", False), "sample_from_anchor: is False")],
    "dspark.markov_rank": [("good", _put("markov_rank", 0), "markov_rank: is 0; SGLang 0.5.23 refuses")],
    "dspark.markov_head_type": [("good", _put("markov_head_type", "rnn"), "markov_head_type: is 'rnn'")],
    "dspark.markov_head_type.vllm": [("gated", lambda data: None, "markov_head_type is gated: vLLM 0.33.0 does not "
                                      "serve this drafter")],
    "dspark.confidence_flags": [("good", _put("enable_confidence_head", "yes"), "enable_confidence_head: is 'yes'")],
    "dspark.confidence_head_with_markov": [("good", _drop("confidence_head_with_markov"),
                                            "confidence_head_with_markov: missing: SGLang 0.5.23 then reads")],
    "dspark.confidence_head_off": [("plain", lambda data: None, CONFIDENCE_OFF_WARNING)],
}

CASES = [pytest.param(rule, base, change, expected, id=f"{rule}-{i}")
         for rule, cases in BROKEN.items() for i, (base, change, expected) in enumerate(cases)]


def test_every_dspark_rule_has_a_drafter_broken_that_way():
    assert sorted(BROKEN) == sorted(r for r in RULES if r.startswith("dspark."))


@pytest.mark.parametrize("rule,base,change,expected", CASES)
def test_each_dspark_rule_meets_a_drafter_broken_that_way(rule, base, change, expected, good, gated, plain,
                                                          qwen3_target, tmp_path):
    path = shutil.copytree({"good": good, "gated": gated, "plain": plain}[base], tmp_path / "broken")
    edit_config(path, change)
    check = inspect_drafter_dir(path, qwen3_target)
    said = [str(f) for f in check.findings if f.rule == rule] + [w for r, w in zip(check.warned, check.warnings)
                                                                 if r == rule]
    assert any(expected in text for text in said), (expected, [str(f) for f in check.findings], check.warnings)
    if rule in WARNING_RULES or rule in VLLM_ONLY:
        assert check.refused() == [], [str(f) for f in check.findings]  # SGLang serves it: the export goes ahead
    else:
        assert all(". Fix: " in str(f) for f in check.findings)
        with pytest.raises(DraftlineError, match="would not load this drafter as it was trained"):
            check.raise_if_refused()


def test_a_good_drafter_passes_without_warnings(good, qwen3_target):
    assert check_drafter_dir(good, qwen3_target) == []


@pytest.mark.parametrize("change,pattern", [
    (_put("model_type", "llama"), "model_type: is 'llama'"),
    (_put("mask_token_id", 320), "mask_token_id: is 320, outside the target's vocabulary [0, 320)"),
    (_put("target_layer_ids", [5, 1]), "target_layer_ids: [5, 1] is not strictly increasing"),
    (_put("target_layer_ids", [1, 7]), "target_layer_ids: [1, 7] holds 7, the target's last layer"),
    (_put("is_causal", True), "is_causal: is True"),
    (_put("hidden_size", 32), "hidden_size: is 32, the target's is 64"),
    (_put("draft_vocab_size", 100), "draft_vocab_size: is 100"),
])
def test_the_backbone_s_rules_read_the_top_level_fields(broken, qwen3_target, change, pattern):
    edit_config(broken, change)
    text = refusal(broken, qwen3_target)
    assert pattern in text and "dflash_config." not in text


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
    (_gate, "markov_head.gate_proj.weight: 1 tensor no engine maps"),
    (_no_confidence, "confidence_head.proj.bias: 1 tensor the engines map is missing"),
    (_w2_shape, "markov_head.markov_w2.weight: has shape (320, 8), the config needs (320, 16)"),
    (_embed, "embed_tokens.weight: a drafter borrows the target's embedding"),
    (_prefix, "has a 'model.' prefix"),
    (_no_layer_norm, "layers.1.input_layernorm.weight: 1 tensor the engines map is missing"),
])
def test_the_tensor_rules_know_the_heads(broken, qwen3_target, change, pattern):
    edit_tensors(broken, change)
    assert pattern in refusal(broken, qwen3_target)


def test_a_confidence_head_size_follows_its_markov_input(broken, qwen3_target):
    edit_config(broken, _put("confidence_head_with_markov", False))
    assert "confidence_head.proj.weight: has shape (1, 80), the config needs (1, 64)" in refusal(broken, qwen3_target)


def test_a_gated_drafter_is_refused_for_vllm_only(gated, qwen3_target, tmp_path):
    check = inspect_drafter_dir(gated, qwen3_target)
    assert check.refused() == []  # SGLang serves it: the export goes ahead
    (vllm,) = check.refused(kinds=("vllm",))
    assert vllm.subject == "markov_head_type" and "builds the vanilla head only" in vllm.problem
    assert check.warnings == [VLLM_GATED_WARNING]
    path = shutil.copytree(gated, tmp_path / "said-vanilla")
    edit_config(path, _put("markov_head_type", "vanilla"))  # a gated drafter said to be vanilla: its gate is named
    assert "markov_head.gate_proj.bias, markov_head.gate_proj.weight: 2 tensors no engine maps" in refusal(
        path, qwen3_target)


def test_a_drafter_without_a_confidence_head_passes_with_a_warning(plain, qwen3_target):
    assert check_drafter_dir(plain, qwen3_target) == [CONFIDENCE_OFF_WARNING]


def test_the_config_rules_refuse_a_dspark_drafter_before_it_is_trained_naming_the_flag(qwen3_target):
    from draftline.model.config import build_drafter_config
    from draftline.model.dspark import build_dspark_config

    target_config = load_target_config(qwen3_target)
    config = build_dspark_config(build_drafter_config(target_config, num_hidden_layers=1, block_size=4,
                                                      target_layer_ids=[1, 7]), markov_rank=8)
    with pytest.raises(DraftlineError) as info:
        check_drafter_config(config, qwen3_target, target_config)
    assert "target_layer_ids (--target-layer-ids): [1, 7] holds 7, the target's last layer" in str(info.value)
    gated = build_dspark_config(build_drafter_config(target_config, num_hidden_layers=1, block_size=4), markov_rank=8,
                                markov_head_type="gated")
    assert check_drafter_config(gated, qwen3_target, target_config) == [VLLM_GATED_WARNING]
