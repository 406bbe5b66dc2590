"""The serving check: each rule refused with a drafter broken that way, named; good drafters pass."""

from __future__ import annotations

import copy
import re
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.serving import check_drafter_dir, inspect_drafter_dir
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config


def make_drafter(target_dir, path, *, layer_types=("full_attention", "full_attention"), sliding_window=None,
                 target_layer_ids=None, target_config=None):
    config = build_drafter_config(target_config or load_target_config(target_dir), num_hidden_layers=2, block_size=8,
                                  layer_types=list(layer_types), sliding_window=sliding_window,
                                  target_layer_ids=target_layer_ids)
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(config).float(), path, dtype=torch.float32)


@pytest.fixture(scope="module")
def good(qwen3_target, tmp_path_factory):
    """A [full, full] block-8 drafter for the 8-layer qwen3 target (hidden 64, vocab 320), target ids [1, 5]."""
    return make_drafter(qwen3_target, tmp_path_factory.mktemp("serving") / "good")


@pytest.fixture()
def broken(good, tmp_path):
    """A fresh copy of the good drafter to break."""
    return shutil.copytree(good, tmp_path / "broken")


def edit_config(path, change):
    data = json.loads((path / "config.json").read_text())
    change(data)
    (path / "config.json").write_text(json.dumps(data))


def edit_tensors(path, change):
    tensors = load_file(path / "model.safetensors")
    tensors = change(tensors) or tensors
    save_file(tensors, path / "model.safetensors")


def refusal(path, target) -> str:
    with pytest.raises(DraftlineError) as info:
        check_drafter_dir(path, target)
    return str(info.value)


def test_a_good_drafter_passes_without_warnings(good, qwen3_target):
    assert check_drafter_dir(good, qwen3_target) == []


def test_a_drafter_resaved_by_the_official_code_passes(good, qwen3_target, tmp_path):
    """A released drafter's form (the official DFlashDraftModel.save_pretrained) is not refused."""
    dflash_model = pytest.importorskip("dflash.model")
    official = dflash_model.DFlashDraftModel.from_pretrained(good, dtype=torch.float32)
    official.save_pretrained(tmp_path / "released")
    assert check_drafter_dir(tmp_path / "released", qwen3_target) == []


# ---- tensors ----------------------------------------------------------------------------------


def _rename(tensors):
    tensors["layers.0.self_attn.query.weight"] = tensors.pop("layers.0.self_attn.q_proj.weight")


def _drop_q_norm(tensors):
    del tensors["layers.1.self_attn.q_norm.weight"]


def _drop_norms(tensors):
    for name in ("hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
                 "layers.0.post_attention_layernorm.weight", "layers.1.mlp.down_proj.weight"):
        del tensors[name]


def _extra(tensors):
    tensors["layers.0.self_attn.g_proj.weight"] = torch.zeros(64, 64)


def _prefix(tensors):
    return {"model." + name: t for name, t in tensors.items()}


def _embed(tensors):
    tensors["embed_tokens.weight"] = torch.zeros(320, 64)


def _lm_head(tensors):
    tensors["lm_head.weight"] = torch.zeros(320, 64)


def _fc_shape(tensors):
    tensors["fc.weight"] = torch.zeros(64, 64)


def _k_norm_shape(tensors):
    tensors["layers.0.self_attn.k_norm.weight"] = torch.ones(64)


@pytest.mark.parametrize("change,expected", [
    (_rename, [r"layers\.0\.self_attn\.query\.weight: 1 tensor no engine maps \(SGLang 0\.5\.23 skips",
               r"layers\.0\.self_attn\.q_proj\.weight: 1 tensor the engines map is missing"]),
    (_drop_q_norm, [r"layers\.1\.self_attn\.q_norm\.weight: 1 tensor the engines map is missing"]),
    (_drop_norms, [r"hidden_norm\.weight, layers\.0\.input_layernorm\.weight, layers\.0\.post_attention_layernorm"
                   r"\.weight, layers\.1\.mlp\.down_proj\.weight, norm\.weight: 5 tensors"]),
    (_extra, [r"layers\.0\.self_attn\.g_proj\.weight: 1 tensor no engine maps"]),
    (_prefix, [r"model\.fc\.weight \(and 24 more\): has a 'model\.' prefix; vLLM 0\.33\.0 prepends"]),
    (_embed, [r"embed_tokens\.weight: a drafter borrows the target's embedding.*Fix: remove embed_tokens\.weight"]),
    (_lm_head, [r"lm_head\.weight: a drafter borrows"]),
    (_fc_shape, [r"fc\.weight: has shape \(64, 64\), the config needs \(64, 128\)"]),
    (_k_norm_shape, [r"layers\.0\.self_attn\.k_norm\.weight: has shape \(64,\), the config needs \(16,\)"]),
])
def test_tensor_rules(broken, qwen3_target, change, expected):
    edit_tensors(broken, change)
    message = refusal(broken, qwen3_target)
    for pattern in expected:
        assert re.search(pattern, message), (pattern, message)


def test_a_model_prefix_is_one_finding_not_every_tensor_missing(broken, qwen3_target):
    edit_tensors(broken, _prefix)
    check = inspect_drafter_dir(broken, qwen3_target)
    assert [f.subject.split(" ")[0] for f in check.findings] == ["model.fc.weight"]


@pytest.mark.parametrize("name", ["model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                  "mask_embedding.pt"])
def test_other_weight_files_beside_the_drafter_are_refused(broken, qwen3_target, name):
    (broken / name).write_bytes(b"{}")
    message = refusal(broken, qwen3_target)
    assert f"{name}:" in message and f"Fix: remove {name}" in message


def test_a_model_card_beside_the_weights_is_fine(broken, qwen3_target):
    (broken / "README.md").write_text("# a drafter\n")
    assert check_drafter_dir(broken, qwen3_target) == []


# ---- config fields ----------------------------------------------------------------------------


def _set(name, value):
    def change(data):
        *parents, leaf = name.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return change


_DELETE = object()


@pytest.mark.parametrize("name,value,pattern", [
    ("architectures", ["DFlash2DraftModel"], "architectures: is ['DFlash2DraftModel']"),
    ("model_type", "llama", "model_type: is 'llama'"),
    ("block_size", 1, "block_size: is 1; it must be an integer >= 2"),
    ("dflash_config.block_size", 16, "dflash_config.block_size: is 16 but the top-level block_size is 8"),
    ("dflash_config.num_target_layers", 36, "dflash_config.num_target_layers: is 36"),
    ("dflash_config.mask_token_id", _DELETE, "dflash_config.mask_token_id: is None"),
    ("is_causal", True, "is_causal: is True: vLLM 0.33.0 and SGLang 0.5.23 make every layer causal"),
    ("dflash_config.causal", False, "dflash_config.causal: is False"),
    ("dflash_config.use_swa", True, "dflash_config.use_swa: is True: vLLM 0.33.0 turns every layer"),
    ("use_aux_hidden_state", False, "use_aux_hidden_state: is False: vLLM 0.33.0 drops fc"),
    ("dflash_config.use_aux_hidden_state", False, "dflash_config.use_aux_hidden_state: is False"),
    ("is_neox_style", False, "is_neox_style: is False"),
    ("use_gemma_norm", True, "use_gemma_norm: is True"),
    ("attention_bias", True, "attention_bias: is True"),
    ("hidden_act", "gelu", "hidden_act: is 'gelu'"),
    ("dflash_config.attention_sink_bias", True, "dflash_config.attention_sink_bias: is True"),
    ("dflash_config.conv_kernel_size", 4, "dflash_config.conv_kernel_size: is 4"),
    ("dflash_config.projector_type", "domino", "dflash_config.projector_type: is 'domino'"),
    ("target_hidden_size", 128, "target_hidden_size: is 128, the target's is 64"),
    ("draft_vocab_size", 100, "draft_vocab_size: is 100, the target's is 320"),
    ("eagle_aux_hidden_state_layer_ids", [1, 5], "eagle_aux_hidden_state_layer_ids: is [1, 5]; vLLM 0.33.0 captures "
                                                 "these layers instead of target_layer_ids + 1 = [2, 6]"),
    ("dflash_config.target_layer_ids", [5, 1], "[5, 1] is not strictly increasing"),
    ("dflash_config.target_layer_ids", [1, 1], "[1, 1] is not strictly increasing"),
    ("dflash_config.target_layer_ids", [1, 7], "[1, 7] holds 7, the target's last layer"),
    ("dflash_config.target_layer_ids", [1, 8], "[1, 8] has [8] outside the target's 8 layers"),
    ("dflash_config.target_layer_ids", [], "dflash_config.target_layer_ids: is []"),
    ("dflash_config.mask_token_id", 320, "is 320, outside the target's vocabulary [0, 320)"),
    ("layer_types", ["full_attention", "linear_attention"], "layer_types: has ['linear_attention']"),
    ("layer_types", ["full_attention"], "layer_types: is ['full_attention'] for num_hidden_layers=2"),
])
def test_config_rules(broken, qwen3_target, name, value, pattern):
    edit_config(broken, _set(name, value))
    message = refusal(broken, qwen3_target)
    assert pattern in message and "Fix: " in message, message


def test_values_that_match_what_was_trained_pass(broken, qwen3_target):
    """A field the engines read is fine when it says what draftline trained with."""
    def change(data):
        data.update(is_neox_style=True, use_aux_hidden_state=True, target_hidden_size=64, draft_vocab_size=320,
                    eagle_aux_hidden_state_layer_ids=[2, 6], attention_bias=False, hidden_act="silu")
        data["dflash_config"].update(block_size=8, num_target_layers=8, use_swa=False)
    edit_config(broken, change)
    assert check_drafter_dir(broken, qwen3_target) == []


def test_no_layer_types_reads_as_full_attention_like_the_engines(broken, qwen3_target):
    """Without layer_types transformers' Qwen3 config (which the engines parse with) derives all-full."""
    edit_config(broken, _set("layer_types", _DELETE))
    assert check_drafter_dir(broken, qwen3_target) == []


# ---- the target -------------------------------------------------------------------------------


def _target_with(qwen3_target, **fields):
    config = copy.deepcopy(load_target_config(qwen3_target))
    for name, value in fields.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("fields,pattern", [
    ({"hidden_size": 96}, "hidden_size: is 64, the target's is 96"),
    ({"vocab_size": 400}, "vocab_size: is 320, the target's is 400"),
    ({"num_hidden_layers": 12}, "num_target_layers: is 8: the drafter was trained for a target of 8 layers, this one has 12"),
    ({"num_hidden_layers": 4}, "[1, 5] has [5] outside the target's 4 layers"),
    ({"vocab_size": 300}, "is 319, outside the target's vocabulary [0, 300)"),
])
def test_target_rules(good, qwen3_target, fields, pattern):
    check = inspect_drafter_dir(good, _target_with(qwen3_target, **fields))
    assert any(pattern in str(f) and f.kind == "target" for f in check.findings), [str(f) for f in check.findings]
    with pytest.raises(DraftlineError, match="would not load this drafter as it was trained"):
        check.raise_if_refused()


def _write_tokenizer(path, vocab):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))


def test_the_tokenizer_s_mask_token_must_be_the_drafter_s(good, qwen3_target, tmp_path):
    """SGLang looks <|MASK|> up in the target's tokenizer and refuses another id than mask_token_id (319)."""
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(qwen3_target / "config.json", target / "config.json")
    _write_tokenizer(target, {"<unk>": 0, "a": 1, "<|MASK|>": 5})
    message = refusal(good, target)
    assert "is 319, but the target's tokenizer has '<|MASK|>' at 5; SGLang 0.5.23 refuses" in message
    _write_tokenizer(target, {"<unk>": 0, "a": 1, "<|MASK|>": 319})
    assert check_drafter_dir(good, target) == []
    _write_tokenizer(target, {"<unk>": 0, "a": 1})  # no mask token in the tokenizer: SGLang takes the id
    assert check_drafter_dir(good, target) == []


# ---- sliding layers and warnings ------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed(qwen3_target, tmp_path_factory):
    return make_drafter(qwen3_target, tmp_path_factory.mktemp("serving") / "mixed",
                        layer_types=("sliding_attention", "full_attention"), sliding_window=16)


def test_mixed_layer_types_pass_with_the_v2_runner_warning(mixed, qwen3_target):
    warnings = check_drafter_dir(mixed, qwen3_target)
    assert len(warnings) == 1 and "VLLM_USE_V2_MODEL_RUNNER=1" in warnings[0] and "vLLM 0.33.0" in warnings[0]


def test_all_sliding_layers_need_no_flag(qwen3_target, tmp_path):
    path = make_drafter(qwen3_target, tmp_path / "d", layer_types=("sliding_attention",) * 2, sliding_window=16)
    assert check_drafter_dir(path, qwen3_target) == []


@pytest.mark.parametrize("change,pattern", [
    (_set("sliding_window", None), "sliding_window: is None; sliding_attention layers need a positive top-level window"),
    (_set("use_sliding_window", _DELETE), "use_sliding_window: is None; transformers' Qwen3 config"),
    (_set("use_sliding_window", False), "use_sliding_window: is False; transformers' Qwen3 config"),
    (_set("dflash_config.swa_window_size", 32), "dflash_config.swa_window_size: is 32 but sliding_window is 16"),
])
def test_sliding_layer_rules(mixed, qwen3_target, tmp_path, change, pattern):
    broken = shutil.copytree(mixed, tmp_path / "broken")
    edit_config(broken, change)
    assert pattern in refusal(broken, qwen3_target)


def test_a_matching_swa_window_size_passes(mixed, qwen3_target, tmp_path):
    broken = shutil.copytree(mixed, tmp_path / "broken")
    edit_config(broken, _set("dflash_config.swa_window_size", 16))
    assert len(check_drafter_dir(broken, qwen3_target)) == 1  # only the mixed-layers warning


def test_another_max_position_embeddings_is_a_warning(broken, qwen3_target):
    edit_config(broken, _set("max_position_embeddings", 128))
    (warning,) = check_drafter_dir(broken, qwen3_target)
    assert "max_position_embeddings is 128, the target's is 512" in warning


def test_every_problem_is_reported_at_once(broken, qwen3_target):
    edit_config(broken, lambda d: d.update(is_causal=True, hidden_act="gelu"))
    edit_tensors(broken, _embed)
    message = refusal(broken, qwen3_target)
    assert "(3 problems)" in message
    assert all(s in message for s in ("is_causal:", "hidden_act:", "embed_tokens.weight:"))
