"""Test helpers: tiny random models built from configs (never downloads)."""

from __future__ import annotations

import torch


def make_qwen3_target(path, *, vocab_size=320, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, seed=0, tie=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie,
        initializer_range=0.2,
    )
    model = Qwen3ForCausalLM(config).float()
    model.save_pretrained(path)
    return path


def make_llama_target(path, *, vocab_size=300, hidden_size=48, num_layers=6, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def layout_for(lengths, anchors_per_doc, block):
    """A BlockLayout for documents of ``lengths`` with the given anchor positions per document."""
    from draftline.model.attention import BlockLayout

    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    a_doc = torch.tensor([d for d, ps in enumerate(anchors_per_doc) for _ in ps])
    a_pos = torch.tensor([p for ps in anchors_per_doc for p in ps])
    return BlockLayout(doc, pos, a_doc, a_pos, block)
