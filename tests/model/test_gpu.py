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
