"""The frozen target's features: the final hidden state for soft labels is what its LM head reads."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from draftline.data.batch import PackedBatch
from draftline.model.target import TargetFeatures


def test_final_hidden_gives_the_targets_own_logits(qwen3_target):
    docs = [list(range(5, 40)), list(range(100, 117))]
    batch = PackedBatch.from_documents([(d, [True] * len(d)) for d in docs])
    plain = TargetFeatures(qwen3_target, [1, 3], dtype=torch.float32)
    teacher = TargetFeatures(qwen3_target, [1, 3], dtype=torch.float32, final_hidden=True)
    hidden = plain.hidden_size
    assert plain.layers_run == 4 and teacher.layers_run == 8
    assert teacher.feature_width == 3 * hidden == plain.feature_width + hidden
    feats = teacher(batch)
    torch.testing.assert_close(feats[:, : 2 * hidden], plain(batch))  # the feature layers are unchanged

    model = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.cat([model(torch.tensor([d])).logits[0] for d in docs])
    logits = feats[:, 2 * hidden :] @ teacher.head_weight().t()
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
