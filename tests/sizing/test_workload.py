"""The reference workload: its length mix, the batches made of it, preflight's worst case."""

from __future__ import annotations

import numpy as np
import torch

from draftline.sizing.workload import (
    DOC_TOKENS, MAX_LENGTH, MEAN_LENGTH, MIN_LENGTH, fill_budget, lognormal_lengths, packed_batch, reference_lengths,
    sampled_batches, worst_case_batch,
)


def test_the_mix_is_log_normal_around_its_mean_within_its_bounds():
    lengths = reference_lengths(count=4096)
    assert lengths.min() >= MIN_LENGTH and lengths.max() <= MAX_LENGTH
    assert abs(lengths.mean() - MEAN_LENGTH) / MEAN_LENGTH < 0.05  # the cap at 8K trims the tail a little
    assert np.array_equal(reference_lengths(), reference_lengths())  # seeded: the planner's rates do not move


def test_lengths_fill_a_budget_without_passing_it():
    rng = np.random.default_rng(3)
    for budget in (4096, 32768, 100):
        lengths = lognormal_lengths(rng, budget)
        assert sum(lengths) <= budget or lengths == [budget]
    assert fill_budget([3, 4, 5], 8) == [3, 4]
    assert fill_budget([9], 8) == [8]


def test_a_packed_batch_trains_all_but_each_documents_prompt():
    batch = packed_batch([100, 11, 64], vocab=50, seed=1, index=2)
    assert batch.doc_lengths.tolist() == [100, 11, 64] and batch.index == 2
    assert int(batch.input_ids.max()) < 49
    untrained = [int((~mask).sum()) for mask in torch.split(batch.loss_mask, batch.doc_lengths.tolist())]
    assert untrained == [20, 2, 12]  # the first fifth of each
    assert torch.equal(packed_batch([100], 50, seed=1).input_ids, packed_batch([100], 50, seed=1).input_ids)


def test_sampled_batches_draw_from_the_lengths_given():
    batches = sampled_batches(np.array([300, 500, 700]), budget=2000, vocab=50, count=3)
    for batch in batches:
        assert batch.num_tokens <= 2000
        assert set(batch.doc_lengths.tolist()) <= {300, 500, 700}
    assert [b.index for b in batches] == [0, 1, 2]


def test_preflights_worst_case_is_documents_of_doc_tokens_every_token_trained():
    batch = worst_case_batch(2 * DOC_TOKENS + 100, vocab=1000)
    assert batch.doc_lengths.tolist() == [DOC_TOKENS, DOC_TOKENS, 100]
    assert bool(batch.loss_mask.all())
