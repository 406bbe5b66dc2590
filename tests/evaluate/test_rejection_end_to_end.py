"""Sampled speculative decoding keeps the target's distribution, end to end.

A tiny target with an 8-token vocabulary and a random drafter (whose distribution is far from the
target's, so most drafts are rejected and the residual path carries the result). Each run
generates 4 tokens with blocks of 3: the first from the prefill, then two drafts, rejection
sampling, and the bonus token when both are kept. The exact distribution of the four tokens comes
from enumerating every continuation with the target alone; a chi-square test per position
compares it with the decoder's runs. With the verifier replaced by one that accepts every draft,
the same test must fail.
"""

from __future__ import annotations

import pytest
import torch

from draftline.evaluate import speculative
from draftline.evaluate.sampling import Sampling, draw, probabilities
from draftline.evaluate.speculative import speculative_generate

VOCAB, NEW_TOKENS, BLOCK = 8, 4, 3
PROMPT = [1, 4, 2, 6]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         initializer_range=0.15, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("small_target")
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    from transformers import AutoModelForCausalLM

    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_marginals(model, sampling: Sampling) -> list[torch.Tensor]:
    """P(token i = v) for i = 1..NEW_TOKENS under target-only sampling, by enumeration."""
    prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * (NEW_TOKENS - 1))  # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        probs = probabilities(model(ids).logits[:, len(PROMPT) - 1:], sampling)  # [V^3, 4, V]
    marginals, path = [], torch.ones(len(prefixes), dtype=torch.float64)
    for i in range(NEW_TOKENS):
        # Every prefix row appears V^(3-i) times; each carries 1/V^(3-i) of its path probability.
        step = probs[:, i].double()
        marginals.append((path[:, None] * step).sum(0) / VOCAB ** (NEW_TOKENS - 1 - i))
        if i < NEW_TOKENS - 1:
            path = path * step.gather(1, prefixes[:, i : i + 1])[:, 0]
    return marginals


def run_many(model, drafter, sampling: Sampling, runs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    out = torch.empty(runs, NEW_TOKENS, dtype=torch.long)
    for r in range(runs):
        result = speculative_generate(model, drafter, PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling,
                                      block_size=BLOCK, generator=g)
        out[r] = torch.tensor(result.output_ids[len(PROMPT):])
    return out


def worst_pvalue(samples, marginals, chi_square) -> float:
    return min(chi_square(torch.bincount(samples[:, i], minlength=VOCAB), marginals[i]) for i in range(NEW_TOKENS))


@pytest.fixture(scope="module")
def drafter(small_target):
    from draftline.model.config import build_drafter_config
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import load_target_config

    config = build_drafter_config(load_target_config(small_target[0]), num_hidden_layers=1, block_size=BLOCK)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float()
    drafter.reset_parameters(std=0.2)
    return drafter.eval()


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_p=0.9, top_k=5)], ids=["t1", "t0.8-p0.9-k5"])
def test_sampled_tokens_follow_the_target_distribution(small_target, drafter, sampling, chi_square):
    model = small_target[1]
    marginals = exact_marginals(model, sampling)
    assert worst_pvalue(run_many(model, drafter, sampling, 200), marginals, chi_square) > 1e-3


def test_accepting_every_draft_fails_the_same_check(small_target, drafter, chi_square, monkeypatch):
    def accept_all(drafts, target_probs, draft_probs, generator=None):
        num_rows, num_drafts = drafts.shape
        return torch.full((num_rows,), num_drafts), draw(target_probs[:, -1], generator)

    monkeypatch.setattr(speculative, "rejection_sample", accept_all)
    model, sampling = small_target[1], Sampling(1.0)
    assert worst_pvalue(run_many(model, drafter, sampling, 120), exact_marginals(model, sampling), chi_square) < 1e-6
