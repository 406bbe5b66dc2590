"""Starting the drafter from the target's top layers."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.model.warm_start import init_from_target


def test_copies_top_layers_norm_and_identity_fc(qwen3_target):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)
    drafter = DFlashDrafter(config).float()
    copied = init_from_target(drafter, qwen3_target, load_target_config(qwen3_target))
    weights = load_file(qwen3_target / "model.safetensors")
    for i, source in enumerate((6, 7)):  # an 8-layer target: its last two layers
        for name, param in drafter.layers[i].named_parameters():
            torch.testing.assert_close(param, weights[f"model.layers.{source}.{name}"])
    torch.testing.assert_close(drafter.norm.weight, weights["model.norm.weight"])
    H = config.hidden_size
    torch.testing.assert_close(drafter.fc.weight[:, -H:], torch.eye(H))
    assert not drafter.fc.weight[:, :-H].any()
    assert len([c for c in copied if c.startswith("layers.")]) == 22


def test_llama_target_keeps_fresh_qk_norms(llama_target):
    config = build_drafter_config(load_target_config(llama_target), num_hidden_layers=1, block_size=4)
    drafter = DFlashDrafter(config).float()
    copied = init_from_target(drafter, llama_target, load_target_config(llama_target))
    assert any("q_proj" in c for c in copied) and not any("q_norm" in c for c in copied)
    assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, torch.ones(config.head_dim))


def test_hybrid_vision_language_target_copies_mlp_and_recentred_norms(qwen3_5_vl_target):
    """Qwen3.5's top layers: a Gated DeltaNet (no attention to copy) and a gated full-attention layer (its
    heads are not the drafter's 32 x 128: the attention block stays fresh as a whole, even k_proj); MLPs copy,
    norms become 1 + w, names come from the language model."""
    config = build_drafter_config(load_target_config(qwen3_5_vl_target), num_hidden_layers=2, block_size=4)
    drafter = DFlashDrafter(config).float()
    fresh = {name: p.clone() for name, p in drafter.layers[1].self_attn.named_parameters()}
    copied = init_from_target(drafter, qwen3_5_vl_target, load_target_config(qwen3_5_vl_target))
    weights = load_file(qwen3_5_vl_target / "model.safetensors")
    prefix = "model.language_model.layers"
    torch.testing.assert_close(drafter.layers[0].mlp.up_proj.weight, weights[f"{prefix}.6.mlp.up_proj.weight"])
    torch.testing.assert_close(drafter.layers[1].input_layernorm.weight,
                               1 + weights[f"{prefix}.7.input_layernorm.weight"])
    torch.testing.assert_close(drafter.norm.weight, 1 + weights["model.language_model.norm.weight"])
    assert all(torch.equal(p, fresh[name]) for name, p in drafter.layers[1].self_attn.named_parameters())
    assert not any("self_attn" in c for c in copied)  # layer 6 is linear attention, layer 7's heads differ
    # Even with the target's own head shape the block stays fresh: its k_proj alone would match, its gated
    # q_proj (twice as wide) does not, and half an attention block is not the target's attention.
    own = build_drafter_config(load_target_config(qwen3_5_vl_target), num_hidden_layers=2, block_size=4,
                               overrides={"num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": 2})
    same = DFlashDrafter(own).float()
    assert same.layers[1].self_attn.k_proj.weight.shape == weights[f"{prefix}.7.self_attn.k_proj.weight"].shape
    copied = init_from_target(same, qwen3_5_vl_target, load_target_config(qwen3_5_vl_target))
    assert not any("self_attn" in c for c in copied)
