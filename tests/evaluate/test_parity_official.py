"""Our speculative decoding against the official ``dflash_generate`` on the same checkpoint.

The official ``DFlashDraftModel`` loads our fp32 export with its own ``from_pretrained``; both
decode with the same target object at temperature 0. Tokens and acceptance lengths must be
identical, prompt by prompt. The trained drafter (a sliding-window layer among full ones, run at
its own block size 8 and at 4) accepts whole blocks on some prompts and little on others, so the
comparison covers full, partial and zero acceptance; a random full-attention drafter adds a second
architecture.
"""

from __future__ import annotations

import time

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model", reason="the official dflash package (test dependency)")

from draftline.checkpoint.export import load_drafter, save_drafter  # noqa: E402
from draftline.evaluate.speculative import speculative_generate  # noqa: E402

UNSEEN_PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [120, 7, 64]]


@pytest.fixture(autouse=True)
def cpu_timing(monkeypatch):
    # The official return_stats times with torch.cuda.synchronize; on CPU, plain wall time.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def official(path):
    return dflash_model.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()


def compare(model, ours, theirs, prompts, *, block_size, max_new_tokens, stop_token_ids=None):
    lengths = []  # per prompt
    for prompt in prompts:
        mine = speculative_generate(model, ours, prompt, max_new_tokens=max_new_tokens,
                                    stop_token_ids=stop_token_ids or (), block_size=block_size)
        ref = dflash_model.dflash_generate(theirs, model, torch.tensor([prompt]), max_new_tokens, stop_token_ids,
                                           temperature=0.0, block_size=block_size, return_stats=True)
        assert mine.output_ids == ref.output_ids[0].tolist(), prompt
        assert mine.acceptance_lengths == list(ref.acceptance_lengths), prompt
        lengths.append(mine.acceptance_lengths)
    return lengths


@pytest.mark.parametrize("block_size", [8, 4])
def test_trained_sliding_window_drafter_matches_official(qwen3_model, trained_drafter, block_size):
    path, prompts = trained_drafter
    per_prompt = compare(qwen3_model, load_drafter(path), official(path), prompts + UNSEEN_PROMPTS,
                         block_size=block_size, max_new_tokens=29)
    lengths = [n for prompt in per_prompt for n in prompt]
    assert max(lengths) == block_size  # whole blocks accepted somewhere
    assert sum(n > 1 for n in lengths) >= 5


def test_stop_tokens_match_official(qwen3_model, trained_drafter):
    path, prompts = trained_drafter
    ours, theirs = load_drafter(path), official(path)
    full = speculative_generate(qwen3_model, ours, prompts[0], max_new_tokens=29)
    stop = full.output_ids[len(prompts[0]) + 12]  # inside an accepted block
    per_prompt = compare(qwen3_model, ours, theirs, prompts, block_size=8, max_new_tokens=29, stop_token_ids=[stop])
    assert sum(per_prompt[0]) <= 12  # stopped early, within a block


def test_random_full_attention_drafter_matches_official(qwen3_target, qwen3_model, make_drafter, tmp_path):
    drafter = make_drafter(qwen3_target, num_layers=3, block_size=4, seed=3)
    path = save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    compare(qwen3_model, load_drafter(path), official(path), UNSEEN_PROMPTS, block_size=4, max_new_tokens=14)
