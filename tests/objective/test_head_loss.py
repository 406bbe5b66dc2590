"""The chunked LM head loss equals the plain computation, value and gradient."""

from __future__ import annotations

import pytest
import torch

from draftline.objective.head_loss import chunked_head_loss, plain_head_loss


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_chunked_equals_plain(chunk, multiplier, softcap):
    torch.manual_seed(0)
    h = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64)
    labels = torch.randint(0, 50, (13,))
    weights = torch.rand(13, dtype=torch.float64)
    loss, correct = chunked_head_loss(h, w, labels, weights, chunk_rows=chunk, multiplier=multiplier, softcap=softcap)
    (grad,) = torch.autograd.grad(loss * 2.5, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref, ref_correct = plain_head_loss(h2, w, labels, weights, multiplier=multiplier, softcap=softcap)
    (ref_grad,) = torch.autograd.grad(ref * 2.5, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
    assert torch.equal(correct, ref_correct)


def test_memory_grows_with_chunk_not_rows(monkeypatch):
    """At most chunk_rows rows of logits exist at once."""
    import draftline.objective.head_loss as hl

    seen = []
    original = hl._chunk_logits

    def spy(h, weight, multiplier, softcap):
        seen.append(h.shape[0])
        return original(h, weight, multiplier, softcap)

    monkeypatch.setattr(hl, "_chunk_logits", spy)
    h = torch.randn(100, 4, requires_grad=True)
    chunked_head_loss(h, torch.randn(30, 4), torch.randint(0, 30, (100,)), torch.ones(100), chunk_rows=16)
    assert max(seen) == 16 and sum(seen) == 100
