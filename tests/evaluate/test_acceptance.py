"""Acceptance summary maths, and the measurement the training loop calls."""

from __future__ import annotations

import pytest
import torch

from draftline.checkpoint.export import load_drafter
from draftline.errors import DraftlineError
from draftline.evaluate.acceptance import format_summary, measure_acceptance, summarize


def test_summary_of_known_lengths():
    summary = summarize([[1, 4, 2], [4, 3], []], block_size=4)
    assert summary["tau"] == pytest.approx(14 / 5)
    assert summary["acceptance_hist"] == [1, 1, 1, 2]
    # slot k accepted <=> at least k + 1 tokens committed
    assert summary["acceptance_by_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert (summary["num_prompts"], summary["num_steps"], summary["block_size"]) == (3, 5, 4)
    text = "\n".join(format_summary(summary))
    assert "tau 2.800" in text and "P(slot k accepted): 1:0.80  2:0.60  3:0.40" in text


def test_summary_rejects_lengths_outside_the_block():
    with pytest.raises(ValueError):
        summarize([[1, 5]], block_size=4)
    assert summarize([], block_size=4)["tau"] == 0.0


def test_measure_acceptance_on_a_trained_drafter(qwen3_model, trained_drafter):
    path, prompts = trained_drafter
    drafter = load_drafter(path)
    greedy = measure_acceptance(qwen3_model, drafter, prompts, max_new_tokens=24)
    assert greedy["num_prompts"] == len(prompts) and greedy["tau"] > 2.5
    assert greedy["num_generated_tokens"] == len(prompts) * 24
    assert sum(greedy["acceptance_hist"]) == greedy["num_steps"]
    assert greedy["acceptance_by_position"] == sorted(greedy["acceptance_by_position"], reverse=True)
    # Sampling is seeded: the same call gives the same numbers; a smaller block caps tau.
    sampled = [measure_acceptance(qwen3_model, drafter, prompts[:1], max_new_tokens=12, temperature=0.7, block_size=4)
               for _ in range(2)]
    assert sampled[0] == sampled[1] and 1 <= sampled[0]["tau"] <= 4
    assert len(sampled[0]["acceptance_hist"]) == 4


def test_measure_acceptance_decodes_a_flex_target_on_sdpa_and_restores_it(qwen3_target, make_drafter, monkeypatch):
    from draftline.evaluate import acceptance
    from draftline.model.target import TargetFeatures

    seen = []
    monkeypatch.setattr(acceptance, "speculative_generate",
                        lambda model, *a, **k: seen.append(model.config._attn_implementation) or _fake_generation())
    drafter = make_drafter(qwen3_target, num_layers=1, block_size=4)
    features = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32,
                              attn_implementation="flex_attention", keep_all_layers=True)
    measure_acceptance(features.model, drafter, [[1, 2, 3]], max_new_tokens=4)
    assert seen == ["sdpa"] and features.model.config._attn_implementation == "flex_attention"

    truncated = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32)  # feature layers only
    with pytest.raises(DraftlineError, match="keep_all_layers"):
        measure_acceptance(truncated.model, drafter, [[1, 2, 3]], max_new_tokens=4)


def _fake_generation():
    from draftline.evaluate.speculative import Generation

    return Generation([1, 2, 3, 4, 5], [1], 3)
