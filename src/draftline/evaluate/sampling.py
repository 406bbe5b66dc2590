"""Token selection for speculative decoding: the sampling distribution, greedy and rejection verification.

The verifier keeps the target's distribution exactly (Leviathan et al. 2023; Chen et al. 2023).
With drafts ``x_1..x_g`` drawn from the drafter's distributions ``q_1..q_g`` and the target's
distributions ``p_1..p_{g+1}`` at the same positions (all after the same temperature, top-k and
top-p), draft ``x_i`` is kept with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
rejection ``i`` the next token is drawn from the residual ``norm(max(p_i - q_i, 0))``, and when
all ``g`` are kept a bonus token is drawn from ``p_{g+1}``. Every committed token is then
distributed as ``p``, whatever ``q`` is. Greedy decoding is the limit where ``p`` and ``q`` are
one-hot: a draft is kept iff it is the target's argmax.

Every function takes a leading batch axis of rows and never synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftline.errors import DraftlineError


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen; the same settings shape the drafter's and the target's distributions."""

    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches top_p (1 = all)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DraftlineError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DraftlineError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DraftlineError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a sampler with ``sampling`` draws from, [..., V] float32 (not for greedy)."""
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kth, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token stays if the mass strictly before it is below top_p, so the most likely one always stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from each distribution of ``probs`` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """A token from each row of logits [..., V]: argmax when greedy, else a draw."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, sampling), generator)


def _kept_prefix(kept: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of [N, g] -> [N]."""
    return kept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def greedy_verify(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [N], next token [N]) for drafts [N, g] against target logits [N, g + 1, V].

    Row i of the logits is the target's prediction for draft slot i + 1; the last row predicts the
    token after a fully accepted block.
    """
    best = target_logits.argmax(dim=-1)  # [N, g + 1]
    accepted = _kept_prefix(drafts == best[:, :-1])
    return accepted, best.gather(-1, accepted[:, None])[:, 0]


def rejection_sample(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [N], next token [N]): speculative sampling of drafts [N, g].

    target_probs [N, g + 1, V] = p_1..p_{g+1}; draft_probs [N, g, V] = q_1..q_g, the distributions
    the drafts were drawn from.
    """
    num_rows, num_drafts = drafts.shape
    p_x = target_probs[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]  # p_i(x_i)
    q_x = draft_probs.gather(-1, drafts[..., None])[..., 0]  # q_i(x_i) > 0: x_i was drawn from q_i
    u = torch.rand(q_x.shape, generator=generator, device=q_x.device, dtype=q_x.dtype)
    accepted = _kept_prefix(u * q_x < p_x)  # u < p/q, without dividing by a tiny q

    # Residual at the first rejection; after a fully kept block q_{g+1} := 0, so it is p_{g+1} itself.
    rows = torch.arange(num_rows, device=drafts.device)
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]
    p_next = target_probs[rows, accepted]
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass == 0 only when p == q, where nothing is ever rejected; fall back to p to stay defined.
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    return accepted, draw(residual, generator)
