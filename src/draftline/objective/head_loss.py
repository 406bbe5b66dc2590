"""The frozen LM head and weighted cross-entropy, in chunks of rows.

``[rows, vocab]`` logits for 8192 query rows per sample at a 152K-248K vocabulary are several GiB;
here at most ``chunk_rows`` rows of logits exist at once. The gradient with respect to the hidden
rows is computed in the same pass (softmax minus the label distribution), so backward stores
``[rows, hidden]``, not logits. The head weight is frozen: no gradient for it.

With ``weigh``, the rows' weights depend on their own cross-entropies (D-PACE, ``objective.dpace``): each
chunk's loss and gradient are taken with ``row_weights``, then every row's are scaled by
``weigh(ce)`` of the detached per-row cross-entropies, so the weights cost no second pass over the head.

With ``teacher`` hidden rows (the target's final hidden state at the position that predicts each
label) and ``distill`` = a in (0, 1], a row's label is the mix ``(1 - a) * one_hot(label) + a * p``,
where ``p`` is the target's own next-token distribution through the same head: soft labels.
"""

from __future__ import annotations

import functools

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float | None):
    return scale_logits(h.to(weight.dtype) @ weight.t(), multiplier, softcap)


def scale_logits(raw: torch.Tensor, multiplier: float, softcap: float | None):
    """(fp32 logits, tanh of the softcap or None): the head's output multiplier and softcap applied to its raw
    logits, without in-place ops."""
    logits = raw.to(torch.promote_types(raw.dtype, torch.float32))
    if multiplier != 1.0:
        logits = logits * multiplier
    tanh = None
    if softcap:
        tanh = torch.tanh(logits / softcap)
        logits = tanh * softcap
    return logits, tanh


def label_is_argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[R] bool: ``logits.argmax(-1) == labels``, ties going to the first maximum as ``argmax``'s do, taken as the
    label's logit being at least the row's maximum and above every logit before it (none before label 0).

    Two plain maxima, which a compiled kernel takes in the loop that finds the log-normaliser's maximum, where
    ``argmax`` is a reduction over (value, index) pairs: on an H100, DFlash's reduction went from 2.54 to 2.23 ms a
    step (docs/benchmarks/2026-12-dspark-step.md, section 9)."""
    picked = logits.gather(1, labels[:, None]).squeeze(1)
    vocab = torch.arange(logits.shape[1], device=logits.device)
    before = torch.where(vocab[None, :] < labels[:, None], logits, float("-inf")).amax(-1)
    return (picked >= logits.amax(-1)) & ((labels == 0) | (picked > before))


def loss_and_grad_of_logits(raw, labels, row_weights, multiplier, softcap, teacher_raw, distill, need_grad):
    """One chunk's (loss sum, correct [R], d loss / d raw logits [R, V] or None, per-row cross-entropy [R]),
    without in-place ops.

    ``raw`` [R, V] are the head's logits in the head's dtype (before multiplier and softcap),
    ``teacher_raw`` the teacher's (or None). The same arithmetic as the eager loop of
    ``_ChunkedHeadLoss``, written functionally so that ``torch.compile`` fuses it into a few
    passes over the logits (on CUDA); the gradient comes back in ``raw``'s dtype.
    """
    logits, tanh = scale_logits(raw, multiplier, softcap)
    w = row_weights.to(logits.dtype)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1)
    soft = None
    if teacher_raw is not None:
        soft = torch.softmax(scale_logits(teacher_raw, multiplier, softcap)[0], dim=-1)
        picked = (1 - distill) * picked + distill * (soft * logits).sum(-1)
    ce = lse - picked
    loss = (ce * w).sum()
    correct = label_is_argmax(logits, labels)
    if not need_grad:
        return loss, correct, None, ce
    grad = torch.exp(logits - lse[:, None])
    vocab = torch.arange(logits.shape[1], device=logits.device)
    grad = torch.where(vocab[None, :] == labels[:, None], grad + (distill - 1.0), grad)  # - (1-a) one-hot
    if soft is not None:
        grad = grad - distill * soft
    grad = grad * w[:, None]
    if tanh is not None:
        grad = grad * (1 - tanh * tanh)
    if multiplier != 1.0:
        grad = grad * multiplier
    return loss, correct, grad.to(raw.dtype), ce


def loss_and_grad_into_logits(raw, labels, row_weights, multiplier, softcap, teacher_raw, distill, need_grad):
    """``loss_and_grad_of_logits`` with the gradient written over ``raw`` (when ``need_grad``): one chunk's
    (loss sum, correct, per-row cross-entropy). Compiled, the gradient goes straight into ``raw``'s memory
    (one ``[R, V]`` buffer per chunk instead of two); the values are those of ``loss_and_grad_of_logits``."""
    loss, correct, grad, ce = loss_and_grad_of_logits(raw, labels, row_weights, multiplier, softcap, teacher_raw,
                                                      distill, need_grad)
    if need_grad:
        raw.copy_(grad)
    return loss, correct, ce


def compile_over_rows(fn, backend: str = "inductor"):
    """``fn`` compiled with each tensor argument's first dimension (its rows: a chunk's, which change with every
    pass) dynamic and the others (the vocabulary, the hidden size) static: a kernel over ``[R, V]`` then finds an
    element's row by dividing its index by a constant instead of a runtime value. Compiled with every size dynamic,
    these kernels moved ~0.8 TB/s on an H200; compiled so, DFlash's step fell from 153.4 to 147.7 ms and DSpark's from
    173.1 to 168.5 (docs/benchmarks/2026-12-dspark-step.md, sections 6-7)."""
    compiled = torch.compile(fn, backend=backend)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args, **kwargs)

    return call


@functools.cache
def _fused_loss_and_grad():
    """``loss_and_grad_into_logits`` compiled (CUDA only), once: 2-3 passes over bf16 logits instead of ~10
    over an fp32 copy, and no second ``[R, V]`` buffer for the gradient."""
    return compile_over_rows(loss_and_grad_into_logits)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows, multiplier, softcap, teacher, distill, fused, weigh):
        need_grad = ctx.needs_input_grad[0]
        rows = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        correct = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        ce_rows = torch.empty(rows, dtype=loss.dtype, device=hidden.device) if weigh is not None else None
        fused = fused and hidden.is_cuda
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            label = labels[start:end]
            if fused:
                raw = hidden[start:end].to(weight.dtype) @ weight.t()
                teacher_raw = None if teacher is None else teacher[start:end].to(weight.dtype) @ weight.t()
                part, correct[start:end], ce = _fused_loss_and_grad()(
                    raw, label, row_weights[start:end], multiplier, softcap, teacher_raw, distill, need_grad)
                del teacher_raw
                loss = loss + part.to(loss.dtype)
                if ce_rows is not None:
                    ce_rows[start:end] = ce
                if need_grad:  # raw holds d loss / d raw logits now
                    grad_hidden[start:end] = (raw @ weight).to(hidden.dtype)
                del raw
                continue
            logits, tanh = _chunk_logits(hidden[start:end], weight, multiplier, softcap)
            w = row_weights[start:end].to(loss.dtype)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, label[:, None]).squeeze(1)
            soft = None
            if teacher is not None:
                soft = torch.softmax(_chunk_logits(teacher[start:end], weight, multiplier, softcap)[0], dim=-1)
                picked = (1 - distill) * picked + distill * (soft * logits).sum(-1)
            loss = loss + ((lse - picked) * w).sum()
            if ce_rows is not None:
                ce_rows[start:end] = lse - picked
            correct[start:end] = logits.argmax(dim=-1) == label
            if need_grad:
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
                grad.scatter_add_(1, label[:, None], torch.full_like(picked, distill - 1.0)[:, None])  # - (1-a) one-hot
                if soft is not None:
                    grad.sub_(soft.mul_(distill))
                grad.mul_(w[:, None])
                if tanh is not None:
                    grad.mul_(1 - tanh * tanh)
                if multiplier != 1.0:
                    grad.mul_(multiplier)
                grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
        if weigh is not None:  # the chunks were taken with row_weights; each row's own weight comes now
            scale = weigh(ce_rows)
            loss = (ce_rows * row_weights.to(loss.dtype) * scale).sum()
            if need_grad:
                grad_hidden.mul_(scale[:, None].to(grad_hidden.dtype))
        ctx.save_for_backward(grad_hidden if need_grad else None)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        grad = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None, None, None, None, None


def chunked_head_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    chunk_rows: int = 4096,
    multiplier: float = 1.0,
    softcap: float | None = None,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    fused: bool = True,
    weigh=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of ``w * CE(logits, label)`` and the top-1 hit of each row.

    hidden [M, H] (after the drafter's final norm), head_weight [V, H] (frozen), labels [M],
    row_weights [M]; teacher [M, H] (the target's final-normed hidden state) when ``distill`` > 0.
    ``fused``: on CUDA, each chunk's loss and gradient in a compiled body (the eager loop otherwise,
    and always on CPU). ``weigh``: a function of the rows' detached cross-entropies [M] giving a factor
    [M] on each row's weight (D-PACE). Returns (loss_sum scalar fp32, correct [M] bool; correct is against the hard labels).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if not 0.0 <= distill <= 1.0:
        raise ValueError(f"distill must be in [0, 1], got {distill}")
    if distill > 0 and teacher is None:
        raise ValueError("distill > 0 needs the teacher's hidden rows")
    teacher = teacher.detach() if distill > 0 else None
    return _ChunkedHeadLoss.apply(hidden, head_weight, labels, row_weights, chunk_rows, multiplier, softcap,
                                  teacher, float(distill), fused, weigh)


def plain_head_loss(hidden, head_weight, labels, row_weights, *, multiplier=1.0, softcap=None, teacher=None,
                    distill=0.0, weigh=None):
    """The same quantity with full logits materialised and autograd's gradient; the reference for tests."""
    logits = _chunk_logits(hidden, head_weight, multiplier, softcap)[0]
    target = torch.nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
    if distill > 0:
        soft = torch.softmax(_chunk_logits(teacher, head_weight, multiplier, softcap)[0], dim=-1)
        target = (1 - distill) * target + distill * soft
    ce = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    weights = row_weights.to(logits.dtype)
    if weigh is not None:
        weights = weights * weigh(ce.detach())
    return (ce * weights).sum(), logits.argmax(-1) == labels
