"""The sampling distribution, greedy verification, and rejection sampling as a pure function.

Rejection sampling is checked statistically with many independent rows in one call: with
context-free target distributions p_1..p_{g+1}, the i-th committed token of a row must be
distributed as p_i (over the rows that got that far), whatever the drafter's q. The same check
on two classic mistakes (accepting drafts unconditionally; drawing the correction from p instead
of the residual max(p - q, 0)) must fail, or the check would prove nothing.
"""

from __future__ import annotations

import pytest
import torch

from draftline.errors import DraftlineError
from draftline.evaluate.sampling import Sampling, draw, greedy_verify, probabilities, rejection_sample


def _reference_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Top-k, softmax, top-p, one row at a time, the slow obvious way."""
    out = torch.zeros_like(logits)
    for r, row in enumerate(logits / s.temperature):
        order = sorted(range(len(row)), key=lambda i: -float(row[i]))
        if s.top_k:
            order = order[: s.top_k]
        p = torch.softmax(row[order], dim=0)
        kept, mass = [], 0.0
        for i, pi in zip(order, p.tolist()):
            if mass >= s.top_p:
                break
            kept.append((i, pi))
            mass += pi
        for i, pi in kept:
            out[r, i] = pi / mass
    return out


@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.8), Sampling(0.6, 0.9, 4)])
def test_probabilities_match_the_definition(s):
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(0)) * 2
    torch.testing.assert_close(probabilities(logits, s), _reference_probs(logits, s), rtol=1e-5, atol=1e-6)


def test_sampling_settings_are_validated():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(DraftlineError):
            Sampling(**bad)


def test_greedy_verify_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    vocab = 7
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # target argmax per row
    logits = torch.nn.functional.one_hot(best, vocab).float()
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [6, 2, 3]])
    accepted, token = greedy_verify(drafts, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert token.tolist() == [4, 2, 1]  # bonus after a full block; else the target's own choice


# ---- rejection sampling, statistically ---------------------------------------------------------

VOCAB, DRAFTS, ROWS = 6, 3, 40_000


def _distributions(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(DRAFTS + 1, VOCAB, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(DRAFTS, VOCAB, generator=g) * 1.5, dim=-1)
    p[0, 5] = 0.0  # a token the target never emits but the drafter proposes
    p[0] /= p[0].sum()
    return p, q


def _committed(accepted: torch.Tensor, drafts: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Rows of committed tokens (kept drafts, then the target's token); -1 past the end."""
    slots = torch.arange(DRAFTS + 1)
    out = torch.full((drafts.shape[0], DRAFTS + 1), -1)
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)
    out = torch.where(slots < accepted[:, None], padded, out)
    return out.scatter(1, accepted[:, None], token[:, None])


def _accept_all(drafts, p, q, generator):
    return torch.full((drafts.shape[0],), DRAFTS), draw(p[:, -1], generator)


def _residual_from_p(drafts, p, q, generator):
    """Right acceptance test, wrong correction: draws from p instead of max(p - q, 0)."""
    rows = torch.arange(drafts.shape[0])
    p_x = p[:, :DRAFTS].gather(-1, drafts[..., None])[..., 0]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(q_x.shape, generator=generator)
    accepted = (u * q_x < p_x).long().cumprod(-1).sum(-1)
    return accepted, draw(p[rows, accepted], generator)


def _worst_pvalue(verify, chi_square) -> float:
    p, q = _distributions()
    g = torch.Generator().manual_seed(1)
    drafts = draw(q.expand(ROWS, -1, -1), g)  # x_i ~ q_i
    accepted, token = verify(drafts, p.expand(ROWS, -1, -1), q.expand(ROWS, -1, -1), g)
    committed = _committed(accepted, drafts, token)
    pvalues = []
    for i in range(DRAFTS + 1):  # token i exists on rows that accepted at least i drafts
        reached = committed[accepted >= i, i]
        counts = torch.bincount(reached, minlength=VOCAB)
        pvalues.append(chi_square(counts, p[i]))
    return min(pvalues)


def test_rejection_sampling_commits_tokens_distributed_as_the_target(chi_square):
    assert _worst_pvalue(rejection_sample, chi_square) > 1e-3


@pytest.mark.parametrize("wrong", [_accept_all, _residual_from_p])
def test_the_statistical_check_catches_wrong_verifiers(wrong, chi_square):
    assert _worst_pvalue(wrong, chi_square) < 1e-8


def test_rejection_sampling_when_drafter_equals_target_accepts_everything():
    p, _ = _distributions()
    g = torch.Generator().manual_seed(2)
    q = p[:DRAFTS].expand(500, -1, -1)
    drafts = draw(q, g)
    accepted, _ = rejection_sample(drafts, p.expand(500, -1, -1), q, g)
    assert accepted.eq(DRAFTS).all()
