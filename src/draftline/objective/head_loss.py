"""The frozen LM head and weighted cross-entropy, in chunks of rows.

``[rows, vocab]`` logits for 8192 query rows per sample at a 152K-248K vocabulary are several GiB;
here at most ``chunk_rows`` rows of logits exist at once. The gradient with respect to the hidden
rows is computed in the same pass (softmax minus one-hot), so backward stores ``[rows, hidden]``,
not logits. The head weight is frozen: no gradient for it.
"""

from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float | None):
    logits = h.to(weight.dtype) @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, fp64 in tests
    if multiplier != 1.0:
        logits = logits * multiplier
    tanh = None
    if softcap:
        tanh = torch.tanh(logits / softcap)
        logits = tanh * softcap
    return logits, tanh


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows, multiplier, softcap):
        need_grad = ctx.needs_input_grad[0]
        rows = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        correct = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            logits, tanh = _chunk_logits(hidden[start:end], weight, multiplier, softcap)
            label = labels[start:end]
            w = row_weights[start:end].to(loss.dtype)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, label[:, None]).squeeze(1)
            loss = loss + ((lse - picked) * w).sum()
            correct[start:end] = logits.argmax(dim=-1) == label
            if need_grad:
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                grad.scatter_add_(1, label[:, None], -torch.ones_like(picked)[:, None])
                grad.mul_(w[:, None])
                if tanh is not None:
                    grad.mul_(1 - tanh * tanh)
                if multiplier != 1.0:
                    grad.mul_(multiplier)
                grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden if need_grad else None)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None


def chunked_head_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    chunk_rows: int = 4096,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of ``w * CE(logits, label)`` and the top-1 hit of each row.

    hidden [M, H] (after the drafter's final norm), head_weight [V, H] (frozen), labels [M],
    row_weights [M]. Returns (loss_sum scalar fp32, correct [M] bool).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _ChunkedHeadLoss.apply(hidden, head_weight, labels, row_weights, chunk_rows, multiplier, softcap)


def plain_head_loss(hidden, head_weight, labels, row_weights, *, multiplier=1.0, softcap=None):
    """The same quantity with full logits materialised; the reference for tests."""
    logits = hidden.to(head_weight.dtype) @ head_weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (ce * row_weights.to(logits.dtype)).sum(), logits.argmax(-1) == labels
