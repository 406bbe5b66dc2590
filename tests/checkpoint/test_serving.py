"""The serving check: every rule (``RULES``) met by a drafter broken that way and named; good drafters pass.

``BROKEN`` holds, for each rule id, the drafters broken for it; ``test_every_rule_has_a_drafter_broken_that_way``
checks that every rule in the package has one, so a rule removed from the code fails its cases and a rule
added without a case fails that test.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.serving import (
    RULES, check_drafter_config, check_drafter_dir, engine_mask_token_id, inspect_drafter_dir,
)
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from helpers import edit_config, edit_tensors

WARNING_RULES = {"mixed_layers", "max_position_embeddings", "rope_parameters.mrope_section", "rope_parameters.target"}


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


@pytest.fixture(scope="module")
def mixed(qwen3_target, tmp_path_factory):
    """The same with [sliding (window 16), full] layers."""
    return make_drafter(qwen3_target, tmp_path_factory.mktemp("serving") / "mixed",
                        layer_types=("sliding_attention", "full_attention"), sliding_window=16)


@pytest.fixture()
def broken(good, tmp_path):
    """A fresh copy of the good drafter to break."""
    return shutil.copytree(good, tmp_path / "broken")


def refusal(path, target) -> str:
    with pytest.raises(DraftlineError) as info:
        check_drafter_dir(path, target)
    return str(info.value)


def write_tokenizer(path, vocab):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))


def target_with_tokenizer(qwen3_target, path, vocab):
    """A copy of the target's config beside a word-level tokenizer.json of ``vocab``."""
    path.mkdir()
    shutil.copy(qwen3_target / "config.json", path / "config.json")
    write_tokenizer(path, vocab)
    return path


# ---- ways to break a drafter: each takes (drafter dir, tmp_path, target dir) and returns the target to check against

_DELETE = object()


def _set(data, name, value):
    *parents, leaf = name.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


def cfg(**fields):
    """config.json fields set (dotted names nest; ``_DELETE`` removes one)."""
    def brk(path, tmp_path, target):
        edit_config(path, lambda data: [_set(data, name.replace("__", "."), value) for name, value in fields.items()])
        return target
    return brk


def tensors(change):
    def brk(path, tmp_path, target):
        edit_tensors(path, change)
        return target
    return brk


def beside(name):
    def brk(path, tmp_path, target):
        (path / name).write_bytes(b"{}")
        return target
    return brk


def remove(name):
    def brk(path, tmp_path, target):
        (path / name).unlink()
        return target
    return brk


def target_fields(**fields):
    """The target's config with other sizes (no tokenizer)."""
    def brk(path, tmp_path, target):
        config = copy.deepcopy(load_target_config(target))
        for name, value in fields.items():
            setattr(config, name, value)
        return config
    return brk


def tokenizer(vocab, **fields):
    """The target with a word-level tokenizer of ``vocab``; ``fields`` set in the drafter's config.json."""
    def brk(path, tmp_path, target):
        cfg(**fields)(path, tmp_path, target)
        return target_with_tokenizer(target, tmp_path / "target", vocab)
    return brk


def unchanged(path, tmp_path, target):
    return target


def _rename(t):
    t["layers.0.self_attn.query.weight"] = t.pop("layers.0.self_attn.q_proj.weight")


def _drop_q_norm(t):
    del t["layers.1.self_attn.q_norm.weight"]


def _drop_norms(t):
    for name in ("hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
                 "layers.0.post_attention_layernorm.weight", "layers.1.mlp.down_proj.weight"):
        del t[name]


def _extra(t):
    t["layers.0.self_attn.g_proj.weight"] = torch.zeros(64, 64)


def _prefix(t):
    return {"model." + name: tensor for name, tensor in t.items()}


def _embed(t):
    t["embed_tokens.weight"] = torch.zeros(320, 64)


def _lm_head(t):
    t["lm_head.weight"] = torch.zeros(320, 64)


def _vocab_maps(t):
    t["d2t"] = torch.zeros(320, dtype=torch.long)
    t["t2d"] = torch.ones(320, dtype=torch.bool)


def _fc_shape(t):
    t["fc.weight"] = torch.zeros(64, 64)


def _k_norm_shape(t):
    t["layers.0.self_attn.k_norm.weight"] = torch.ones(64)


_MASK_AT_5 = {"<unk>": 0, "a": 1, "<|MASK|>": 5}
_ENGINES = "vLLM 0.33.0 and SGLang 0.5.23"

# rule id -> [(the drafter it starts from, how it is broken, what the finding or warning says)]
BROKEN: dict[str, list[tuple]] = {
    # config.json: what the engines build
    "architectures": [("good", cfg(architectures=["DFlash2DraftModel"]), "architectures: is ['DFlash2DraftModel']")],
    "model_type": [("good", cfg(model_type="llama"), "model_type: is 'llama'")],
    "dflash_config": [("good", cfg(dflash_config=_DELETE), "dflash_config: missing")],
    "block_size": [("good", cfg(block_size=1), "block_size: is 1; it must be an integer >= 2")],
    "dflash_config.block_size": [("good", cfg(dflash_config__block_size=16),
                                  "dflash_config.block_size: is 16 but the top-level block_size is 8")],
    "dflash_config.num_target_layers": [("good", cfg(dflash_config__num_target_layers=36),
                                         "dflash_config.num_target_layers: is 36")],
    "dflash_config.mask_token_id": [("good", cfg(dflash_config__mask_token_id=_DELETE),
                                     "dflash_config.mask_token_id: is None")],
    "mask_token": [("good", cfg(dflash_config__mask_token=5), "dflash_config.mask_token: is 5: SGLang 0.5.23 refuses"),
                   ("good", cfg(mask_token=""), "mask_token: is '': SGLang 0.5.23 refuses")],
    "is_causal": [("good", cfg(is_causal=True), f"is_causal: is True: {_ENGINES} make every layer causal")],
    "dflash_config.causal": [("good", cfg(dflash_config__causal=False), "dflash_config.causal: is False")],
    "dflash_config.use_swa": [("good", cfg(dflash_config__use_swa=True),
                               "dflash_config.use_swa: is True: vLLM 0.33.0 turns every layer")],
    "use_aux_hidden_state": [
        ("good", cfg(use_aux_hidden_state=False), "use_aux_hidden_state: is False: vLLM 0.33.0 (which reads"),
        ("good", cfg(dflash_config__use_aux_hidden_state=False), "dflash_config.use_aux_hidden_state: is False"),
        ("good", cfg(eagle_config__use_aux_hidden_state=False), "eagle_config.use_aux_hidden_state: is False: vLLM"),
    ],
    "is_neox_style": [("good", cfg(is_neox_style=False), "is_neox_style: is False: vLLM 0.33.0")],
    "rope_is_neox_style": [("good", cfg(rope_is_neox_style=False),
                            "rope_is_neox_style: is False: SGLang 0.5.23 rotates interleaved pairs")],
    "use_gemma_norm": [("good", cfg(use_gemma_norm=True), "use_gemma_norm: is True: SGLang 0.5.23 builds Gemma")],
    "attention_bias": [("good", cfg(attention_bias=True), "attention_bias: is True")],
    "hidden_act": [("good", cfg(hidden_act="gelu"), "hidden_act: is 'gelu'")],
    "dflash_config.attention_sink_bias": [("good", cfg(dflash_config__attention_sink_bias=True),
                                           f"dflash_config.attention_sink_bias: is True: {_ENGINES} add")],
    "add_swa_attention_sink_bias": [("good", cfg(add_swa_attention_sink_bias=True),
                                     "add_swa_attention_sink_bias: is True: vLLM 0.33.0 adds per-head attention sinks")],
    "dflash_config.attention_value_scale": [("good", cfg(dflash_config__attention_value_scale=0.5),
                                             f"dflash_config.attention_value_scale: is 0.5: {_ENGINES} scale")],
    "dflash_config.conv_kernel_size": [("good", cfg(dflash_config__conv_kernel_size=4),
                                        "dflash_config.conv_kernel_size: is 4: SGLang 0.5.23 adds grouped")],
    "dflash_config.selector_rank": [("good", cfg(dflash_config__selector_rank=8),
                                     "dflash_config.selector_rank: is 8: draftline trains no candidate selector")],
    "dflash_config.selector_top_k": [("good", cfg(dflash_config__selector_top_k=4),
                                      "dflash_config.selector_top_k: is 4: draftline trains no candidate selector")],
    "projector_type": [
        ("good", cfg(dflash_config__projector_type="domino"), "dflash_config.projector_type: is 'domino': SGLang"),
        ("good", cfg(projector_type="domino"), "projector_type: is 'domino': SGLang 0.5.23 reads dflash_config's, else"),
    ],
    "quantization": [
        ("good", cfg(quantization_config={"quant_method": "fp8"}), f"quantization_config: is set: {_ENGINES} build"),
        ("good", cfg(compression_config={"quant_method": "compressed-tensors"}), "compression_config: is set"),
        ("good", beside("hf_quant_config.json"), f"hf_quant_config.json: {_ENGINES} read the drafter's quantization"),
    ],
    "rope_parameters.rope_dim": [("good", cfg(rope_parameters__rope_dim=8),
                                  f"rope_parameters.rope_dim: is 8: {_ENGINES} rotate that many dimensions of each "
                                  "head; draftline rotates all 16")],
    "rope_parameters.partial_rotary_factor": [
        ("good", cfg(rope_parameters__partial_rotary_factor=0.5),
         "rope_parameters.partial_rotary_factor: is 0.5 (transformers moves a top-level one there): vLLM 0.33.0"),
        ("good", cfg(partial_rotary_factor=0.25), "rope_parameters.partial_rotary_factor: is 0.25"),
    ],
    "rope_parameters.mrope_section": [("good", cfg(rope_parameters__mrope_section=[2, 3, 3]),
                                       "rope_parameters.mrope_section is [2, 3, 3]: vLLM 0.33.0's V1 model runner "
                                       "refuses")],
    "rope_parameters.target": [("good", cfg(rope_parameters__rope_theta=1e6),
                                "rope_parameters {'rope_theta': 1000000.0, 'rope_type': 'default'} differ from the "
                                "target's {'rope_theta': 10000.0, 'rope_type': 'default'}")],
    # config.json against the target
    "hidden_size": [("good", target_fields(hidden_size=96), "hidden_size: is 64, the target's is 96")],
    "vocab_size": [("good", target_fields(vocab_size=400), "vocab_size: is 320, the target's is 400")],
    "target_hidden_size": [("good", cfg(target_hidden_size=128), "target_hidden_size: is 128, the target's is 64")],
    "draft_vocab_size": [("good", cfg(draft_vocab_size=100), "draft_vocab_size: is 100, the target's is 320; "
                                                             "vLLM 0.33.0 builds a draft LM head of that many rows")],
    "num_target_layers": [("good", target_fields(num_hidden_layers=12), "num_target_layers: is 8: the drafter was "
                                                                        "trained for a target of 8 layers, this one has 12")],
    "mask_token_id.range": [
        ("good", cfg(dflash_config__mask_token_id=320), "is 320, outside the target's vocabulary [0, 320)"),
        ("good", target_fields(vocab_size=300), "is 319, outside the target's vocabulary [0, 300)"),
    ],
    "tokenizer_mask_token": [
        ("good", tokenizer(_MASK_AT_5), "dflash_config.mask_token_id: is 319, but the target's tokenizer has "
                                        "'<|MASK|>' (SGLang's default mask token) at 5; SGLang 0.5.23 refuses"),
        ("good", tokenizer({"<unk>": 0, "<mask>": 7}, mask_token="<mask>"),
         "is 319, but the target's tokenizer has '<mask>' (mask_token) at 7"),
        ("good", tokenizer({"<unk>": 0, "<mask>": 7}, dflash_config__mask_token="<mask>", mask_token="<|MASK|>"),
         "has '<mask>' (dflash_config.mask_token) at 7"),
    ],
    "target_layer_ids": [("good", cfg(dflash_config__target_layer_ids=[]), "dflash_config.target_layer_ids: is []")],
    "target_layer_ids.range": [
        ("good", cfg(dflash_config__target_layer_ids=[1, 8]), "[1, 8] has [8] outside the target's 8 layers"),
        ("good", target_fields(num_hidden_layers=4), "[1, 5] has [5] outside the target's 4 layers"),
    ],
    "target_layer_ids.order": [
        ("good", cfg(dflash_config__target_layer_ids=[5, 1]), "[5, 1] is not strictly increasing"),
        ("good", cfg(dflash_config__target_layer_ids=[1, 1]), "[1, 1] is not strictly increasing"),
    ],
    "target_layer_ids.last_layer": [("good", cfg(dflash_config__target_layer_ids=[1, 7]),
                                     "[1, 7] holds 7, the target's last layer")],
    "eagle_aux_hidden_state_layer_ids": [("good", cfg(eagle_aux_hidden_state_layer_ids=[1, 5]),
                                          "eagle_aux_hidden_state_layer_ids: is [1, 5]; vLLM 0.33.0 captures these "
                                          "layers instead of target_layer_ids + 1 = [2, 6]")],
    # attention layers
    "layer_types": [("good", cfg(layer_types=["full_attention"]),
                     "layer_types: is ['full_attention'] for num_hidden_layers=2")],
    "layer_types.unknown": [("good", cfg(layer_types=["full_attention", "linear_attention"]),
                             "layer_types: has ['linear_attention']")],
    "use_sliding_window": [
        ("mixed", cfg(use_sliding_window=_DELETE), "use_sliding_window: is None; transformers' Qwen3 config"),
        ("mixed", cfg(use_sliding_window=False), "use_sliding_window: is False; transformers' Qwen3 config"),
    ],
    "sliding_window": [("mixed", cfg(sliding_window=None),
                        "sliding_window: is None; sliding_attention layers need a positive top-level window")],
    "dflash_config.swa_window_size": [("mixed", cfg(dflash_config__swa_window_size=32),
                                       "dflash_config.swa_window_size: is 32 but sliding_window is 16")],
    "mixed_layers": [("mixed", unchanged, "vLLM 0.33.0 runs such a drafter only on its V2 model runner (its default; "
                                          "it refuses the drafter on V1): serve with VLLM_USE_V2_MODEL_RUNNER=1")],
    "max_position_embeddings": [("good", cfg(max_position_embeddings=128),
                                 "max_position_embeddings is 128, the target's is 512: SGLang 0.5.23 sizes")],
    # files and tensors
    "model.safetensors": [("good", remove("model.safetensors"), "model.safetensors: missing")],
    "weight_files": [("good", beside("model-00002-of-00002.safetensors"), "model-00002-of-00002.safetensors: vLLM"),
                     ("good", beside("model.safetensors.index.json"), "model.safetensors.index.json: vLLM 0.33.0 loads")],
    "mask_embedding.pt": [("good", beside("mask_embedding.pt"), f"mask_embedding.pt: {_ENGINES} put it in place")],
    "sizes": [("good", cfg(intermediate_size=-1), "config.json: its sizes build no drafter")],
    "model_prefix": [("good", tensors(_prefix), "model.fc.weight (and 24 more): has a 'model.' prefix; vLLM 0.33.0 "
                                                "prepends")],
    "embed_tokens_lm_head": [
        ("good", tensors(_embed), "embed_tokens.weight: a drafter borrows the target's embedding"),
        ("good", tensors(_lm_head), "lm_head.weight: a drafter borrows"),
    ],
    "vocab_map": [("good", tensors(_vocab_maps), "d2t, t2d: a draft-to-target vocabulary map: vLLM 0.33.0 loads 'd2t'")],
    "unknown_tensors": [
        ("good", tensors(_rename), "layers.0.self_attn.query.weight: 1 tensor no engine maps (SGLang 0.5.23 skips"),
        ("good", tensors(_extra), "layers.0.self_attn.g_proj.weight: 1 tensor no engine maps"),
    ],
    "missing_tensors": [
        ("good", tensors(_rename), "layers.0.self_attn.q_proj.weight: 1 tensor the engines map is missing"),
        ("good", tensors(_drop_q_norm), "layers.1.self_attn.q_norm.weight: 1 tensor the engines map is missing"),
        ("good", tensors(_drop_norms), "hidden_norm.weight, layers.0.input_layernorm.weight, "
                                       "layers.0.post_attention_layernorm.weight, layers.1.mlp.down_proj.weight, "
                                       "norm.weight: 5 tensors"),
    ],
    "tensor_shape": [
        ("good", tensors(_fc_shape), "fc.weight: has shape (64, 64), the config needs (64, 128)"),
        ("good", tensors(_k_norm_shape), "layers.0.self_attn.k_norm.weight: has shape (64,), the config needs (16,)"),
    ],
}

CASES = [pytest.param(rule, base, brk, expected, id=f"{rule}-{i}")
         for rule, cases in BROKEN.items() for i, (base, brk, expected) in enumerate(cases)]


def test_every_rule_has_a_drafter_broken_that_way():
    # DSpark's rules (dspark.*) have theirs in test_dspark_serving.py.
    assert sorted(BROKEN) == sorted(r for r in RULES if not r.startswith("dspark."))
    assert WARNING_RULES <= set(RULES)


@pytest.mark.parametrize("rule,base,brk,expected", CASES)
def test_each_rule_meets_a_drafter_broken_that_way(rule, base, brk, expected, good, mixed, qwen3_target, tmp_path):
    path = shutil.copytree({"good": good, "mixed": mixed}[base], tmp_path / "broken")
    target = brk(path, tmp_path, qwen3_target)
    check = inspect_drafter_dir(path, target)
    said = [str(f) for f in check.findings if f.rule == rule] + [w for r, w in zip(check.warned, check.warnings)
                                                                 if r == rule]
    assert any(expected in text for text in said), (expected, [str(f) for f in check.findings], check.warnings)
    if rule in WARNING_RULES:
        assert not check.findings, [str(f) for f in check.findings]
    else:
        assert all(". Fix: " in str(f) for f in check.findings)
        with pytest.raises(DraftlineError, match="would not load this drafter as it was trained"):
            check.raise_if_refused()


# ---- good drafters, and fields that say what was trained ----------------------------------------


def test_a_good_drafter_passes_without_warnings(good, qwen3_target):
    assert check_drafter_dir(good, qwen3_target) == []


def test_a_drafter_resaved_by_the_official_code_passes(good, qwen3_target, tmp_path):
    """A released drafter's form (the official DFlashDraftModel.save_pretrained) is not refused."""
    dflash_model = pytest.importorskip("dflash.model")
    official = dflash_model.DFlashDraftModel.from_pretrained(good, dtype=torch.float32)
    official.save_pretrained(tmp_path / "released")
    assert check_drafter_dir(tmp_path / "released", qwen3_target) == []


def test_a_model_prefix_is_one_finding_not_every_tensor_missing(broken, qwen3_target):
    edit_tensors(broken, _prefix)
    check = inspect_drafter_dir(broken, qwen3_target)
    assert [f.subject.split(" ")[0] for f in check.findings] == ["model.fc.weight"]


def test_a_model_card_beside_the_weights_is_fine(broken, qwen3_target):
    (broken / "README.md").write_text("# a drafter\n")
    assert check_drafter_dir(broken, qwen3_target) == []


def test_values_that_match_what_was_trained_pass(broken, qwen3_target):
    """A field the engines read is fine when it says what draftline trained with."""
    def change(data):
        data.update(is_neox_style=True, rope_is_neox_style=True, use_aux_hidden_state=True, target_hidden_size=64,
                    draft_vocab_size=320, eagle_aux_hidden_state_layer_ids=[2, 6], attention_bias=False,
                    hidden_act="silu", mask_token="<|MASK|>")
        data["dflash_config"].update(block_size=8, num_target_layers=8, use_swa=False, selector_rank=0)
        data["rope_parameters"].update(partial_rotary_factor=1.0)
    edit_config(broken, change)
    assert check_drafter_dir(broken, qwen3_target) == []


def test_the_field_an_engine_reads_first_decides(broken, qwen3_target):
    """vLLM reads use_aux_hidden_state from dflash_config before eagle_config and the top level, and
    dflash_config.attention_sink_bias before add_swa_attention_sink_bias: where the first says what
    was trained, the others are not read."""
    def change(data):
        data.update(use_aux_hidden_state=False, eagle_config={"use_aux_hidden_state": False},
                    add_swa_attention_sink_bias=True)
        data["dflash_config"].update(use_aux_hidden_state=True, attention_sink_bias=False)
    edit_config(broken, change)
    assert check_drafter_dir(broken, qwen3_target) == []


def test_the_tokenizer_s_mask_token_at_the_drafter_s_row_passes(good, qwen3_target, tmp_path):
    target = target_with_tokenizer(qwen3_target, tmp_path / "target", {"<unk>": 0, "a": 1, "<|MASK|>": 319})
    assert check_drafter_dir(good, target) == []
    write_tokenizer(target, {"<unk>": 0, "a": 1})  # no mask token in the tokenizer: SGLang takes the id
    assert check_drafter_dir(good, target) == []


def test_no_layer_types_reads_as_full_attention_like_the_engines(broken, qwen3_target):
    """Without layer_types transformers' Qwen3 config (which the engines parse with) derives all-full."""
    edit_config(broken, lambda data: data.pop("layer_types"))
    assert check_drafter_dir(broken, qwen3_target) == []


def test_all_sliding_layers_need_no_flag(qwen3_target, tmp_path):
    path = make_drafter(qwen3_target, tmp_path / "d", layer_types=("sliding_attention",) * 2, sliding_window=16)
    assert check_drafter_dir(path, qwen3_target) == []


def test_a_matching_swa_window_size_passes(mixed, qwen3_target, tmp_path):
    broken = shutil.copytree(mixed, tmp_path / "broken")
    edit_config(broken, lambda data: data["dflash_config"].update(swa_window_size=16))
    assert len(check_drafter_dir(broken, qwen3_target)) == 1  # only the mixed-layers warning


def test_a_larger_max_position_embeddings_than_the_target_s_is_fine(broken, qwen3_target):
    edit_config(broken, lambda data: data.update(max_position_embeddings=4096))
    assert check_drafter_dir(broken, qwen3_target) == []


def test_findings_for_another_target_are_of_the_target_kind(good, qwen3_target):
    check = inspect_drafter_dir(good, target_fields(hidden_size=96, vocab_size=400)(good, None, qwen3_target))
    assert {f.rule for f in check.findings if f.kind == "target"} >= {"hidden_size", "vocab_size"}


def test_every_problem_is_reported_at_once(broken, qwen3_target):
    edit_config(broken, lambda d: d.update(is_causal=True, hidden_act="gelu"))
    edit_tensors(broken, _embed)
    message = refusal(broken, qwen3_target)
    assert "(3 problems; rules read from their sources, not a run of their code)" in message
    assert all(s in message for s in ("is_causal:", "hidden_act:", "embed_tokens.weight:"))


# ---- before training: the drafter a run is about to train -----------------------------------------


def test_the_config_rules_refuse_a_drafter_before_it_is_trained_naming_the_flag(qwen3_target, tmp_path):
    target_config = load_target_config(qwen3_target)
    target = target_with_tokenizer(qwen3_target, tmp_path / "target", {"<unk>": 0, "<|MASK|>": 300})
    config = build_drafter_config(target_config, num_hidden_layers=2, block_size=8, target_layer_ids=[1, 7],
                                  mask_token_id=319)
    with pytest.raises(DraftlineError) as info:
        check_drafter_config(config, target, target_config)
    message = str(info.value)
    assert "the drafter this run would train is one vLLM 0.33.0 and SGLang 0.5.23 would not load" in message
    assert "(2 problems; rules read from their sources, not a run of their code); nothing was trained" in message
    assert ("dflash_config.target_layer_ids (--target-layer-ids): [1, 7] holds 7, the target's last layer" in message
            and "Fix: train with target_layer_ids below 7" in message)
    assert ("dflash_config.mask_token_id (--mask-token-id): is 319, but the target's tokenizer has '<|MASK|>'" in message
            and "Fix: train with mask_token_id 300" in message)
    fixed = build_drafter_config(target_config, num_hidden_layers=2, block_size=8, mask_token_id=300)
    assert check_drafter_config(fixed, target, target_config) == []


def test_the_mask_token_the_engines_check_is_the_tokenizer_s(qwen3_target, tmp_path):
    config = load_target_config(qwen3_target)
    assert engine_mask_token_id(qwen3_target, config) is None  # no tokenizer
    target = target_with_tokenizer(qwen3_target, tmp_path / "target", {"<unk>": 0, "<|MASK|>": 300})
    assert engine_mask_token_id(target, config) == 300
    write_tokenizer(target, {"<unk>": 0, "<|MASK|>": 400})  # beyond the embedding: no row to train with
    assert engine_mask_token_id(target, config) is None
