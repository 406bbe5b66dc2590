"""Drafter config from the target's: the layer rule, sizes, and clear errors."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config

from draftline.errors import DraftlineError
from draftline.model.config import (
    build_drafter_config,
    check_matches_target,
    default_target_layer_ids,
)
from draftline.model.target import load_target_config


def test_zlab_layer_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_target_layer_ids(36, 1) == [18]


def test_sizes_follow_the_target_and_overrides_apply():
    target = Qwen3Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                         intermediate_size=200, num_hidden_layers=12, vocab_size=500, max_position_embeddings=4096)
    config = build_drafter_config(target, num_hidden_layers=3, block_size=8, overrides={"intermediate_size": 64})
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (96, 6, 2, 32)
    assert config.intermediate_size == 64
    assert config.max_position_embeddings == 4096
    assert config.dflash_config["target_layer_ids"] == default_target_layer_ids(12, 3)
    assert config.layer_types == ["full_attention"] * 3


def test_llama_target(llama_target):
    config = build_drafter_config(load_target_config(llama_target), num_hidden_layers=2)
    assert config.hidden_size == 48 and config.head_dim == 12 and config.tie_word_embeddings


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"mask_token_id": 320}, "mask_token_id=320 is outside"),
        ({"mask_token_id": -1}, "outside the target's vocabulary"),
        ({"block_size": 1}, "block_size must be an integer >= 2"),
        ({"target_layer_ids": [0, 8]}, "must lie in [0, 8)"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "needs sliding_window"),
        ({"layer_types": ["causal", "full_attention"]}, "unknown"),
    ],
)
def test_bad_drafter_settings_name_the_field(qwen3_target, kwargs, needle):
    with pytest.raises(DraftlineError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, **kwargs)


def test_drafter_that_cannot_match_target(qwen3_target, llama_target):
    drafter = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2)
    with pytest.raises(DraftlineError, match="hidden_size 64 != target's 48"):
        check_matches_target(drafter, load_target_config(llama_target))
    check_matches_target(drafter, load_target_config(qwen3_target))
    small = LlamaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=320, num_attention_heads=4)
    with pytest.raises(DraftlineError, match="exceed the target's 3 layers"):
        check_matches_target(drafter, small)


def _qwen3_6_27b_text_config():
    """Qwen3.6-27B's text config (its shapes; nothing is allocated)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


def test_hybrid_target_defaults_follow_the_public_drafter():
    """z-lab's Qwen3.6-27B-DFlash: 5 layers of the target's width, layers [1, 16, 31, 46, 61], block 16,
    mask token 248070, sliding x4 + full with window 2048, 32 attention heads of 128 with 8 KV heads (the
    target has gated 24 x 256 with 4)."""
    config = build_drafter_config(_qwen3_6_27b_text_config())
    assert config.hidden_size == 5120 and config.num_hidden_layers == 5 and config.block_size == 16
    assert config.dflash_config == {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and config.sliding_window == 2048
    assert config.intermediate_size == 17408 and config.rope_parameters["rope_theta"] == 1e7
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (32, 128, 8)
    assert "partial_rotary_factor" not in config.rope_parameters  # the drafter rotates whole heads


def test_moe_target_without_dense_width(qwen3_5_moe_target):
    config = build_drafter_config(load_target_config(qwen3_5_moe_target), num_hidden_layers=2)
    assert config.intermediate_size == 3 * config.hidden_size
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (32, 128, 4)


def test_a_resume_onto_another_drafter_names_every_changed_flag(qwen3_target, tmp_path):
    import json

    import torch

    from draftline.checkpoint.export import drafter_config_dict
    from draftline.model.config import refuse_changed_drafter

    target = load_target_config(qwen3_target)
    saved = build_drafter_config(target, num_hidden_layers=2, block_size=4, target_layer_ids=[1, 3])
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(drafter_config_dict(saved, torch.float32)))
    refuse_changed_drafter(tmp_path, saved)  # the same drafter
    refuse_changed_drafter(tmp_path / "older", saved)  # no drafter/config.json: nothing to compare
    other = build_drafter_config(target, num_hidden_layers=3, block_size=8, mask_token_id=5,
                                 layer_types=["sliding_attention"] * 3, sliding_window=16)
    with pytest.raises(DraftlineError) as info:
        refuse_changed_drafter(tmp_path, other)
    message = str(info.value)
    for text in ("--mask-token-id 5 (the checkpoint's drafter has 319)",
                 "--target-layer-ids [1, 3, 5] (the checkpoint's drafter has [1, 3])",
                 "--block-size 8 (the checkpoint's drafter has 4)", "--draft-layers 3 (the checkpoint's drafter has 2)",
                 "--layer-types ['sliding_attention', 'sliding_attention', 'sliding_attention']",
                 "resume with --mask-token-id 319 --target-layer-ids 1,3 --block-size 4 --draft-layers 2 "
                 "--layer-types full_attention,full_attention"):
        assert text in message, message
