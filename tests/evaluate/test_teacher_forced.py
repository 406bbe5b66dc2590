"""Chained teacher-forced acceptance is what greedy speculative decoding measures."""

from __future__ import annotations

import torch

from draftline.checkpoint.export import load_drafter
from draftline.evaluate.acceptance import summarize
from draftline.evaluate.speculative import speculative_generate
from draftline.evaluate.teacher_forced import teacher_forced_acceptance

OTHER_PROMPTS = [[90, 91, 92, 93], [250, 4, 18, 18, 300, 61, 7]]


def test_chained_estimate_reproduces_decoding_block_by_block(trained_drafter, qwen3_model):
    path, train_prompts = trained_drafter
    drafter = load_drafter(path, dtype=torch.float32).eval()
    prompts = train_prompts + OTHER_PROMPTS
    generations = [speculative_generate(qwen3_model, drafter, p, max_new_tokens=30, block_size=drafter.block_size)
                   for p in prompts]
    hooks = lambda: [dict(layer._forward_hooks) for layer in qwen3_model.get_decoder().layers]  # noqa: E731
    hooks_before = hooks()
    # The decoded text is the target's greedy continuation: exactly the contexts teacher forcing sees.
    result = teacher_forced_acceptance(qwen3_model, drafter, [(g.output_ids, len(p)) for g, p in zip(generations, prompts)])
    measured = summarize([g.acceptance_lengths for g in generations], drafter.block_size)["tau"]
    for g, chained in zip(generations, result["chained_lengths"]):
        # Every step but the last, which the token limit (decoding) or the text's end (here) cuts.
        assert chained[:-1] == g.acceptance_lengths[: len(chained) - 1]
        assert abs(len(chained) - len(g.acceptance_lengths)) <= 1
    assert measured > 1.5  # the drafter is accepted often: the comparison is not between two 1.0s
    assert abs(result["chained"] - measured) <= 0.1 * measured, (result, measured)
    assert result["num_positions"] > result["num_blocks"] > 0
    assert hooks() == hooks_before  # the model is left as it was
