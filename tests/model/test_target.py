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


def test_target_config_is_read_once_and_handed_out_as_copies(qwen3_target, monkeypatch):
    from transformers import AutoConfig

    from draftline.model import target as target_module

    target_module._read_config.cache_clear()
    reads = []
    real = AutoConfig.from_pretrained
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda *a, **k: reads.append(a) or real(*a, **k))
    first = target_module.load_target_config(qwen3_target)
    first.num_hidden_layers = 1  # a caller truncating its copy
    second = target_module.load_target_config(qwen3_target)
    assert len(reads) == 1 and second.num_hidden_layers == 8
