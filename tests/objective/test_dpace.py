"""D-PACE's weights and loss against SpecForge 0.2.0's own code (installed --no-deps by the test set-up)."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from draftline.objective.dpace import dpace_weights
from draftline.objective.head_loss import chunked_head_loss, plain_head_loss

peer = pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                           reason="specforge==0.2.0 --no-deps (make test installs it)")


def _peer_self(alpha: float, head: torch.Tensor, block_size: int):
    """What SpecForge's OnlineDFlashModel methods read of ``self``, without building its drafter."""
    this = types.SimpleNamespace(dpace_alpha=alpha, loss_type="dpace", block_size=block_size, loss_decay_gamma=None)
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=head.dtype)
    lm_head.weight.data.copy_(head)
    this.lm_head = lm_head
    this._dpace_weight = functools.partial(peer.OnlineDFlashModel._dpace_weight, this)
    return this


def _blocks(num_anchors: int, block_size: int, seed: int):
    """A validity mask [N, B] as the objective builds it: slot 0 never labelled, some labels missing inside
    blocks (a masked-out token) and at their ends (a document's end)."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(num_anchors, block_size, generator=gen) > 0.2
    valid[:, 0] = False
    valid[0, 5:] = False  # a block cut by its document's end
    return valid


@pytest.mark.parametrize("alpha", [0.5, 0.3, 1.0])
def test_weights_equal_the_peers(alpha):
    torch.manual_seed(0)
    valid = _blocks(7, 8, seed=1)
    prob = torch.rand(7, 8, dtype=torch.float64)
    label_rows = torch.nonzero(valid.reshape(-1)).flatten()
    ce = -torch.log(prob.reshape(-1)[label_rows])
    ours = dpace_weights(ce, label_rows, 7, 8, alpha)
    this = _peer_self(alpha, torch.zeros(1, 1, dtype=torch.float64), 8)
    theirs = this._dpace_weight(prob, valid.double(), valid, "dpace")
    torch.testing.assert_close(ours, theirs.reshape(-1)[label_rows], rtol=1e-12, atol=0)


def test_a_slot_without_a_label_is_neutral():
    """Removing an unlabelled slot from a block leaves every other slot's weight as it was."""
    ce = torch.tensor([0.1, 0.7, 0.3, 2.0], dtype=torch.float64)
    with_gap = dpace_weights(ce, torch.tensor([1, 2, 4, 5]), 1, 6, 0.5)  # slot 3 unlabelled
    without = dpace_weights(ce, torch.tensor([1, 2, 3, 4]), 1, 5, 0.5)
    torch.testing.assert_close(with_gap, without, rtol=1e-15, atol=0)


def test_the_first_slot_weighs_most_and_weights_follow_the_formula():
    ce = torch.tensor([0.2, 0.4, 1.5], dtype=torch.float64)
    s = 0.5 * torch.exp(-ce) + 0.5
    prefix = torch.cumprod(s, 0)
    expected = torch.stack([prefix.sum(), prefix[1:].sum(), prefix[2:].sum()])
    got = dpace_weights(ce, torch.tensor([1, 2, 3]), 1, 4, 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)
    assert got[0] > got[1] > got[2]


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_loss_and_gradient_equal_the_peers_objective(chunk):
    """Our chunked head loss with D-PACE's weights against SpecForge's ``_dflash_objective_chunk_terms``
    (full logits, autograd): the loss numerator and the gradient of the hidden rows."""
    torch.manual_seed(3)
    num_anchors, block_size, hidden_size, vocab = 6, 8, 16, 40
    valid = _blocks(num_anchors, block_size, seed=2)
    head = torch.randn(vocab, hidden_size, dtype=torch.float64)
    target_ids = torch.randint(0, vocab, (num_anchors, block_size))
    hidden = torch.randn(num_anchors * block_size, hidden_size, dtype=torch.float64, requires_grad=True)

    this = _peer_self(0.5, head, block_size)
    theirs, *_ = peer.OnlineDFlashModel._dflash_objective_chunk_terms(
        this, hidden.view(1, num_anchors, block_size, hidden_size), target_ids[None], valid[None].double())
    (their_grad,) = torch.autograd.grad(theirs, hidden)

    label_rows = torch.nonzero(valid.reshape(-1)).flatten()
    weigh = lambda ce: dpace_weights(ce, label_rows, num_anchors, block_size, 0.5)  # noqa: E731
    rows = hidden.detach()[label_rows].requires_grad_(True)
    labels = target_ids.reshape(-1)[label_rows]
    ones = torch.ones(label_rows.shape[0], dtype=torch.float64)
    ours, _ = chunked_head_loss(rows, head, labels, ones, chunk_rows=chunk, weigh=weigh)
    (grad_rows,) = torch.autograd.grad(ours, rows)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0)
    our_grad = torch.zeros_like(their_grad)
    our_grad[label_rows] = grad_rows
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-9, atol=1e-12)

    plain, _ = plain_head_loss(hidden.detach()[label_rows], head, labels, ones, weigh=weigh)
    torch.testing.assert_close(plain, theirs.detach(), rtol=1e-10, atol=0)
