"""The GPU paths against the CPU references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model.attention import DenseAttention, FlexAttention
from draftline.model.target import TargetFeatures
from helpers import layout_for

pytestmark = pytest.mark.gpu


def test_flex_drafter_attention_equals_dense_on_cuda():
    torch.manual_seed(0)
    lengths = [900, 77, 1500]
    anchors = [list(range(1, 890, 13)), list(range(0, 70, 9)), list(range(5, 1490, 11))]
    layout = layout_for(lengths, anchors, 16).to("cuda")
    q = torch.randn(1, 8, layout.num_queries, 64, device="cuda")
    k = torch.randn(1, 2, layout.num_context + layout.num_queries, 64, device="cuda")
    v = torch.randn_like(k)
    types = ["full_attention", "sliding_attention"]
    flex, dense = FlexAttention(layout, types, 256, 0.125), DenseAttention(layout, types, 256, 0.125)
    for layer in range(2):
        torch.testing.assert_close(flex(q, k, v, layer), dense(q, k, v, layer), rtol=2e-3, atol=2e-3)


def test_flex_target_features_equal_per_document_sdpa(qwen3_target):
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 300, (n,), generator=g).tolist(), [True] * n) for n in (300, 7, 513, 129)]
    batch = PackedBatch.from_documents(docs)
    flex = TargetFeatures(qwen3_target, [1, 4], device="cuda", dtype=torch.float32)
    assert flex.attn == "flex_attention"
    sdpa = TargetFeatures(qwen3_target, [1, 4], device="cuda", dtype=torch.float32, attn_implementation="sdpa")
    out = flex(batch)
    start = 0
    for n in batch.doc_lengths.tolist():
        one = PackedBatch.from_documents([docs.pop(0)])
        torch.testing.assert_close(out[start : start + n], sdpa(one), rtol=1e-3, atol=1e-3)
        start += n


def _gpu_hybrid_target(path, moe: bool):
    """A small hybrid target with head sizes like the real ones' kernels see (64-wide heads)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(0)
    sizes = dict(vocab_size=512, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=8192,
                 initializer_range=0.05, tie_word_embeddings=False)
    if moe:
        config = Qwen3_5MoeTextConfig(**sizes, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                      num_experts=4, num_experts_per_tok=2)
        Qwen3_5MoeForCausalLM(config).save_pretrained(path)
    else:
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes, intermediate_size=512)).save_pretrained(path)
    return path


@pytest.mark.parametrize("moe,dtype,tol", [(False, torch.float32, 2e-3), (True, torch.float32, 2e-3),
                                           (False, torch.bfloat16, 3e-2)], ids=["qwen3_5-fp32", "qwen3_5_moe-fp32",
                                                                                 "qwen3_5-bf16"])
def test_packed_hybrid_features_equal_each_document_alone(tmp_path, moe, dtype, tol):
    """Packed (fla kernels given the boundaries, flex block mask) vs transformers' own forward on each document
    alone: equal within the dtype's rounding. Documents shorter and longer than fla's 64-token chunks."""
    pytest.importorskip("fla")
    target_dir = _gpu_hybrid_target(tmp_path / "target", moe)
    g = torch.Generator().manual_seed(0)
    lengths = [300, 7, 1000, 129, 2]
    docs = [(torch.randint(0, 500, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    packed = TargetFeatures(target_dir, [1, 3, 6], device="cuda", dtype=dtype)
    assert packed.packed and packed.hybrid
    alone = TargetFeatures(target_dir, [1, 3, 6], device="cuda", dtype=dtype, attn_implementation="sdpa")
    assert not alone.packed
    out = packed(PackedBatch.from_documents(docs))
    start = 0
    for doc, n in zip(docs, lengths):
        reference = alone(PackedBatch.from_documents([doc]))
        scale = reference.abs().mean()
        torch.testing.assert_close(out[start : start + n] / scale, reference / scale, rtol=tol, atol=tol)
        start += n
