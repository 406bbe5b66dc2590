"""DSpark's two full-vocabulary terms, in chunks of rows, with their gradients formed in the forward.

For a labelled row with drafter hidden state ``h``, Markov latent ``l`` (``model.dspark.MarkovHead.latent``),
label ``y``, teacher hidden state ``t`` (the target's final hidden state at the row's teacher position) and
weight ``w``:

    z = head(h) + W2 l              (the Markov-corrected logits; head = the target's frozen LM head with its
                                     output multiplier and softcap)
    q = softmax(z), p = softmax(head(t))           (fp32, over the full vocabulary)
    CE = logsumexp(z) - z[y]                        L1 = sum_v |q_v - p_v|  (= 2 TV)
    accept = clamp(1 - L1 / 2, 0, 1)                (the expected acceptance of the slot's draft: detached)

and the function returns ``sum w (ce_weight CE + l1_weight L1)`` with the gradients of ``h``, ``l`` and ``W2``:

    dz = w (ce_weight (q - onehot(y)) + l1_weight q (s - <s, q>)),   s = sign(q - p)

(the L1 term's gradient through the softmax; ``sign(0) = 0``, as autograd's ``abs``), ``dh = dz_raw W_head``,
``dl = dz W2``, ``dW2 = dz^T l``. Backward then only scales them: nothing of ``[rows, vocab]`` is kept.

The matmuls (the head, the bias ``l W2^T`` and the three gradients) run in the head's dtype (bf16 in training,
as DeepSpec's under autocast); the softmaxes, the reductions and ``dz`` in fp32. Where the head's logits are not
scaled (multiplier 1, no softcap: most targets) the bias is added in the head's own matmul (``addmm`` into the
logits, one rounding of the sum), so z is one buffer in the head's dtype and ``dz`` is the raw logits' gradient too;
scaled logits keep the bias in a buffer of its own, added in fp32 after the scaling. On CUDA each chunk's work between
the matmuls is three compiled stages (``dspark_chunk_terms_into``): the rows' log-normalisers (the teacher's once per
distinct teacher row), CE and hits; their L1 distances and ``<s, q>``; the gradients, written over the student's
logits (and the bias). Each stage reads the bf16 buffers (the student's and the teacher's logits, the bias where
it is apart) again and hands on per-row numbers only, so a chunk costs at most ``FUSED_BYTES_PER_LOGIT`` (6) bytes
per row and vocabulary entry, 4 or less with unscaled logits. On the H200, 4,096 rows at
V = 151,936 in chunks of 1,024 peaked 0.81 GiB above their inputs compiled, unscaled (1.10 with a softcap, and
unscaled before the bias was folded; the gradients returned included;
1.68 GiB when one compiled body kept an fp32 buffer between its passes) and 3.71 GiB in the eager loop, which
CPU runs (the fp32 logits, log-softmax, distributions, their difference and sign, in place where it can).
``W2``'s gradient is one fp32 [V, r] buffer for the whole call (254 MB at V = 248,320, r = 256).

Where the kernel takes the logits (CUDA, a bf16 or fp16 head, unscaled: ``dspark_row_kernel.takes``), the three
stages' work runs instead in one Triton kernel whose programs each hold a row through its three passes, so that
the second and third can read it from L2 (``objective.dspark_row_kernel``): at the 8B
step's 8,181 rows, 5.1 ms against the stages' 8.7 on an H100 (docs/benchmarks/2026-12-dspark-step.md, section 13).
It allocates nothing of ``[R, V]``.

Overlapping blocks share teacher rows (slot k of anchor p reads the target at p + k): given each chunk's distinct
teacher rows (``teacher_offsets``, ``teacher_index``: ``objective.dspark_blocks.distinct_teacher_rows``), the
teacher's logits are computed once per distinct row and each row reads its own by index, inside the compiled
stages. At 512 anchors in a 3,072-token sample that is 3,002 rows of 8,181, so the teacher's buffer and its
``[rows, H] x [H, V]`` product shrink to about 0.37 of a row each.
"""

from __future__ import annotations

import functools

import torch

from draftline.objective import dspark_row_kernel
from draftline.objective.head_loss import compile_over_rows, label_is_argmax, scale_logits

CHUNK_ROWS = 2048
"""Labelled rows of one chunk by default (``objective.dspark.DSparkLoss.chunk_rows`` says why)."""

FUSED_BYTES_PER_LOGIT = 6
"""Bytes per row and vocabulary entry of one compiled chunk (CUDA), at most: the three bf16 buffers, the student's and
the teacher's logits and the Markov bias, which then hold the two gradients (unscaled logits take the bias into
their own buffer: two). The compiled stages pass each other
per-row numbers only (tests/objective/test_dspark_head_loss.py measures the bound on CUDA, softcap included). With
distinct teacher rows the teacher's buffer holds fewer rows than the chunk: the bound stays, with room to spare."""


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float | None):
    """(logits [R, V], d logits / d raw or None): the head as ``objective.head_loss`` applies it. Plain logits stay
    in the head's dtype (the caller's fp32 softmax reads them without an fp32 copy); scaled ones are fp32 (fp64 for
    an fp64 head)."""
    raw = h.to(weight.dtype) @ weight.t()
    if multiplier == 1.0 and not softcap:
        return raw, None
    logits = raw.to(torch.promote_types(weight.dtype, torch.float32))
    del raw
    if multiplier != 1.0:
        logits.mul_(multiplier)
    slope = None
    if softcap:
        logits.div_(softcap).tanh_()
        slope = (1 - logits * logits) * multiplier  # d softcap(m raw) / d raw
        logits.mul_(softcap)
    return logits, slope


def _logits_and_bias(h, latent, weight, w2, unscaled):
    """(raw logits, Markov bias or None), both [R, V] in the head's dtype. Unscaled logits take the bias in the
    head's matmul, and the bias is None: z in one buffer, as DeepSpec's bf16 sum under autocast has it. The bias
    comes first and the head's matmul adds into it (``addmm`` with the bias as its input, summed in its accumulator,
    rounded once): the small matmul writes the buffer and the large one reads it where its time is in the
    arithmetic, not the bytes (the other order was 0.2-0.5 ms slower a DSpark step at the 8B shape on an H100,
    docs/benchmarks/2026-12-dspark-step.md, section 11). Scaled logits need the bias apart: it is added after the
    scaling."""
    bias = latent @ w2.t()
    if unscaled:  # in place; torch's FLOP counter sees addmm.out
        return torch.addmm(bias, h.to(weight.dtype), weight.t(), out=bias), None
    return h.to(weight.dtype) @ weight.t(), bias


def _student_logits(raw, bias, multiplier, softcap):
    """(z, tanh of the softcap or None), fp32, recomputed from the bf16 buffers by each stage below rather than kept.
    ``bias`` None: ``raw`` holds z already (unscaled logits with the Markov bias added in the head's matmul)."""
    logits, tanh = scale_logits(raw, multiplier, softcap)
    return (logits if bias is None else logits + bias.to(logits.dtype)), tanh


def _teacher_logits(teacher_raw, teacher_index, multiplier, softcap):
    """Each row's teacher logits, fp32: ``teacher_index`` (or None: one teacher row per row) picks each row's
    teacher among the chunk's distinct ones, an indexed read fused into each compiled stage."""
    teacher = teacher_raw if teacher_index is None else teacher_raw[teacher_index]
    return scale_logits(teacher, multiplier, softcap)[0]


def chunk_stats(raw, bias, teacher_raw, labels, multiplier, softcap):
    """Stage 1, reductions over the vocabulary: (logsumexp z [R], logsumexp of each of ``teacher_raw``'s rows (its
    distinct rows: [U]; None without a teacher), CE [R], correct [R])."""
    z, _ = _student_logits(raw, bias, multiplier, softcap)
    lse_z = torch.logsumexp(z, dim=-1)
    ce = lse_z - z.gather(1, labels[:, None]).squeeze(1)
    lse_t = None if teacher_raw is None else torch.logsumexp(scale_logits(teacher_raw, multiplier, softcap)[0], dim=-1)
    return lse_z, lse_t, ce, label_is_argmax(z, labels)


def _q_and_difference(z, t, lse_z, lse_t):
    """(q, q - p) from the logits and their log-normalisers (``lse_t`` a row's own)."""
    q = torch.exp(z - lse_z[:, None])
    return q, (q - torch.exp(t - lse_t[:, None]))


def chunk_distances(raw, bias, teacher_raw, teacher_index, lse_z, lse_t, multiplier, softcap):
    """Stage 2, reductions: (L1 = sum |q - p| [R], <sign(q - p), q> [R])."""
    z, _ = _student_logits(raw, bias, multiplier, softcap)
    q, diff = _q_and_difference(z, _teacher_logits(teacher_raw, teacher_index, multiplier, softcap), lse_z, lse_t)
    return diff.abs().sum(-1), (diff.sign() * q).sum(-1)


def chunk_gradients(raw, bias, teacher_raw, teacher_index, labels, row_weights, lse_z, lse_t, sign_q, ce_weight,
                    l1_weight, multiplier, softcap):
    """Stage 3, elementwise: (dz [R, V], d loss / d raw [R, V]), fp32, each row's weight (not yet normalised)
    included."""
    z, tanh = _student_logits(raw, bias, multiplier, softcap)
    q, diff = _q_and_difference(z, _teacher_logits(teacher_raw, teacher_index, multiplier, softcap), lse_z, lse_t)
    grad_z = q * (ce_weight + l1_weight * (diff.sign() - sign_q[:, None]))
    vocab = torch.arange(z.shape[1], device=z.device)
    grad_z = torch.where(vocab[None, :] == labels[:, None], grad_z - ce_weight, grad_z)
    grad_z = grad_z * row_weights.to(z.dtype)[:, None]
    grad_raw = grad_z
    if tanh is not None:
        grad_raw = grad_raw * (1 - tanh * tanh)
    if multiplier != 1.0:
        grad_raw = grad_raw * multiplier
    return grad_z, grad_raw


def chunk_gradients_into(raw, bias, teacher_raw, teacher_index, labels, row_weights, lse_z, lse_t, sign_q, ce_weight,
                         l1_weight, multiplier, softcap):
    """``chunk_gradients`` written over its inputs: ``dz`` over ``bias``, ``d loss / d raw`` over ``raw`` (with
    ``bias`` None the two are one, written over ``raw``)."""
    grad_z, grad_raw = chunk_gradients(raw, bias, teacher_raw, teacher_index, labels, row_weights, lse_z, lse_t,
                                       sign_q, ce_weight, l1_weight, multiplier, softcap)
    if bias is not None:
        bias.copy_(grad_z)
    raw.copy_(grad_raw)


_STAGES = (chunk_stats, chunk_distances, chunk_gradients_into)


def _unscaled(multiplier, softcap) -> bool:
    """Whether the head's logits are used as they are: then the Markov bias can be added in the head's matmul."""
    return multiplier == 1.0 and not softcap


def _check_bias(bias, multiplier, softcap):
    if bias is None and not _unscaled(multiplier, softcap):
        raise ValueError("the Markov bias can be folded into the logits only when they are not scaled (multiplier 1, "
                         "no softcap): it is added after the scaling")


def _row_lse_t(lse_t, teacher_index):
    """Each row's teacher log-normaliser from its distinct row's."""
    return lse_t if teacher_index is None else lse_t[teacher_index]


def dspark_chunk_terms(raw, bias, teacher_raw, labels, row_weights, ce_weight, l1_weight, multiplier, softcap,
                       need_grad, teacher_index=None):
    """One chunk's (CE [R], L1 [R], correct [R], dz [R, V] or None, d loss / d raw [R, V] or None), functionally.

    ``raw`` and ``teacher_raw`` are the head's logits of the student's and the teacher's rows in the head's dtype
    (before multiplier and softcap), ``bias`` the Markov bias ``l W2^T``, or None when ``raw`` holds z already (the
    bias added in the head's matmul: unscaled logits only); with ``teacher_index`` [R], ``teacher_raw`` holds the
    chunk's distinct teacher rows and row i reads ``teacher_raw[teacher_index[i]]``. The same arithmetic as the
    eager loop of ``_DSparkHeadLoss`` (the module docstring), in three stages that each read the bf16 buffers again
    and pass on only per-row numbers; the gradients carry each row's weight (not yet normalised), in fp32.
    """
    _check_bias(bias, multiplier, softcap)
    lse_z, lse_t, ce, correct = chunk_stats(raw, bias, teacher_raw, labels, multiplier, softcap)
    lse_t = _row_lse_t(lse_t, teacher_index)
    l1, sign_q = chunk_distances(raw, bias, teacher_raw, teacher_index, lse_z, lse_t, multiplier, softcap)
    if not need_grad:
        return ce, l1, correct, None, None
    grad_z, grad_raw = chunk_gradients(raw, bias, teacher_raw, teacher_index, labels, row_weights, lse_z, lse_t,
                                       sign_q, ce_weight, l1_weight, multiplier, softcap)
    return ce, l1, correct, grad_z, grad_raw


def dspark_chunk_terms_into(raw, bias, teacher_raw, labels, row_weights, ce_weight, l1_weight, multiplier, softcap,
                            need_grad, teacher_index=None, stages=_STAGES):
    """``dspark_chunk_terms`` with the gradients written over the inputs (when ``need_grad``): ``dz`` over
    ``bias``, ``d loss / d raw`` over ``raw``, each in its buffer's dtype (``bias`` None: the one gradient over
    ``raw``). Returns (CE, L1, correct). With each stage compiled (``stages``: CUDA), nothing of ``[R, V]`` is
    allocated beyond the buffers the caller made: the stages hand each other per-row numbers only."""
    _check_bias(bias, multiplier, softcap)
    lse_z, lse_t, ce, correct = stages[0](raw, bias, teacher_raw, labels, multiplier, softcap)
    lse_t = _row_lse_t(lse_t, teacher_index)
    l1, sign_q = stages[1](raw, bias, teacher_raw, teacher_index, lse_z, lse_t, multiplier, softcap)
    if need_grad:
        stages[2](raw, bias, teacher_raw, teacher_index, labels, row_weights, lse_z, lse_t, sign_q, ce_weight,
                  l1_weight, multiplier, softcap)
    return ce, l1, correct


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b``, ``total`` in fp32 and the factors in the head's dtype. On CUDA with bf16 or fp16 factors,
    cuBLAS adds the product into ``total`` in its fp32 accumulator (``addmm`` with ``out_dtype``): the product is
    not rounded to the factors' dtype first and no separate addition reads ``total`` again. Elsewhere the product is
    formed in the factors' dtype and added."""
    if total.is_cuda and total.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


@functools.cache
def _compiled_stages():
    """The three stages compiled (CUDA only), once each: compiled apart, no stage can keep an fp32 [R, V] buffer
    for the next."""
    return tuple(compile_over_rows(stage) for stage in _STAGES)


@functools.cache
def _fused_terms():
    """``dspark_chunk_terms_into`` with each stage compiled (CUDA only)."""
    return functools.partial(dspark_chunk_terms_into, stages=_compiled_stages())


class _DSparkHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, latent, w2, head, labels, teacher, row_weights, ce_weight, l1_weight, chunk_rows,
                multiplier, softcap, fused, teacher_index, teacher_offsets, row_kernel):
        # Under autocast the fp32 reductions and the Markov matmuls would run in bf16: the head's matmuls take
        # the head's dtype explicitly, everything else stays fp32.
        with torch.autocast(hidden.device.type, enabled=False):
            return _DSparkHeadLoss._forward(ctx, hidden, latent, w2, head, labels, teacher, row_weights, ce_weight,
                                            l1_weight, chunk_rows, multiplier, softcap, fused, teacher_index,
                                            teacher_offsets, row_kernel)

    @staticmethod
    def _forward(ctx, hidden, latent, w2, head, labels, teacher, row_weights, ce_weight, l1_weight, chunk_rows,
                 multiplier, softcap, fused, teacher_index, teacher_offsets, row_kernel):
        need_h, need_latent, need_w2 = ctx.needs_input_grad[:3]
        need_grad = need_h or need_latent or need_w2
        rows = hidden.shape[0]
        device = hidden.device
        dtype = torch.promote_types(head.dtype, torch.float32)
        ce_sum = torch.zeros((), dtype=dtype, device=device)
        l1_sum = torch.zeros((), dtype=dtype, device=device)
        accept = torch.empty(rows, dtype=dtype, device=device)
        correct = torch.empty(rows, dtype=torch.bool, device=device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_latent = torch.empty_like(latent) if need_latent else None
        grad_w2 = torch.zeros(w2.shape, dtype=dtype, device=device) if need_w2 else None
        mm = head.dtype  # every matmul in the head's dtype (bf16 in training, as under autocast); the rest fp32
        w2_mm = w2.to(mm)
        unscaled = _unscaled(multiplier, softcap)
        body = None if not fused else _fused_terms() if hidden.is_cuda else dspark_chunk_terms_into
        if body is not None and row_kernel and hidden.is_cuda and dspark_row_kernel.takes(mm, multiplier, softcap):
            body = dspark_row_kernel.dspark_rows_into
        for chunk, start in enumerate(range(0, rows, chunk_rows)):
            end = min(start + chunk_rows, rows)
            label = labels[start:end]
            lat = latent[start:end].to(mm)
            weights = row_weights[start:end].to(dtype)
            if teacher_offsets is None:  # a teacher row per row
                chunk_teacher, pick = teacher[start:end], None
            else:  # the chunk's distinct teacher rows, and each row's among them
                chunk_teacher = teacher[teacher_offsets[chunk] : teacher_offsets[chunk + 1]]
                pick = teacher_index[start:end]
            if body is not None:
                raw, bias = _logits_and_bias(hidden[start:end], lat, head, w2_mm, unscaled)
                teacher_raw = chunk_teacher.to(mm) @ head.t()
                ce, l1, correct[start:end] = body(raw, bias, teacher_raw, label, weights, ce_weight, l1_weight,
                                                  multiplier, softcap, need_grad, pick)
                del teacher_raw
                accept[start:end] = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
                ce_sum = ce_sum + (ce * weights).sum()
                l1_sum = l1_sum + (l1 * weights).sum()
                if need_grad:  # bias holds dz now, raw the gradient of the raw logits (one buffer when unscaled)
                    grad_z = raw if bias is None else bias
                    if need_w2:
                        _add_product(grad_w2, grad_z.t(), lat)
                    if need_latent:
                        grad_latent[start:end] = (grad_z @ w2_mm).to(latent.dtype)
                    if need_h:
                        grad_h[start:end] = (raw @ head).to(hidden.dtype)
                    del grad_z  # else it would hold this chunk's buffer through the next chunk
                del raw, bias
                continue
            if unscaled:  # z as the compiled path forms it: the bias added in the head's matmul
                z = _logits_and_bias(hidden[start:end], lat, head, w2_mm, True)[0].to(dtype)
                slope = None
            else:
                z, slope = _scaled_logits(hidden[start:end], head, multiplier, softcap)
                z = z.to(dtype)
                z += lat @ w2_mm.t()  # + the Markov bias W2 l
            log_q = torch.log_softmax(z, dim=-1)
            del z
            ce = -log_q.gather(1, label[:, None]).squeeze(1)
            correct[start:end] = log_q.argmax(dim=-1) == label
            q = log_q.exp_()  # in place
            raw, _ = _scaled_logits(chunk_teacher, head, multiplier, softcap)
            diff = torch.log_softmax(raw, dim=-1, dtype=dtype).exp_()  # p, the same arithmetic as q
            del raw
            if pick is not None:
                diff = diff[pick]  # each row's p from its chunk's distinct teacher rows
            diff = diff.neg_().add_(q)  # q - p, in place
            l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)  # |.| inside the reduction: no temporary
            accept[start:end] = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
            ce_sum = ce_sum + (ce * weights).sum()
            l1_sum = l1_sum + (l1 * weights).sum()
            if not need_grad:
                continue
            sign = diff.sign_()
            sign_q = torch.bmm(sign[:, None, :], q[:, :, None]).view(-1)  # <s, q> per row
            sign.sub_(sign_q[:, None]).mul_(l1_weight).add_(ce_weight)
            grad_z = q.mul_(sign)  # ce_weight q + l1_weight q (s - <s, q>)
            grad_z[torch.arange(end - start, device=device), label] -= ce_weight
            grad_z.mul_(weights[:, None])
            del sign
            grad_mm = grad_z.to(mm)
            if need_w2:
                _add_product(grad_w2, grad_mm.t(), lat)
            if need_latent:
                grad_latent[start:end] = (grad_mm @ w2_mm).to(latent.dtype)
            if need_h:
                if slope is not None or multiplier != 1.0:  # through the softcap and the multiplier to the raw logits
                    grad_mm = grad_z.mul_(slope if slope is not None else multiplier).to(mm)
                grad_h[start:end] = (grad_mm @ head).to(hidden.dtype)
        ctx.save_for_backward(grad_h, grad_latent, None if grad_w2 is None else grad_w2.to(w2.dtype))
        loss = ce_weight * ce_sum + l1_weight * l1_sum
        ctx.mark_non_differentiable(ce_sum, l1_sum, accept, correct)
        return loss, ce_sum, l1_sum, accept, correct

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*scaled, None, None, None, None, None, None, None, None, None, None, None, None, None)


def dspark_head_loss(
    hidden: torch.Tensor,
    latent: torch.Tensor,
    w2: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher: torch.Tensor,
    row_weights: torch.Tensor,
    *,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    chunk_rows: int = CHUNK_ROWS,
    multiplier: float = 1.0,
    softcap: float | None = None,
    fused: bool | None = None,
    teacher_index: torch.Tensor | None = None,
    teacher_offsets: tuple[int, ...] | None = None,
    row_kernel: bool = True,
):
    """(loss, ce_sum, l1_sum, accept [M], correct [M]) of the labelled rows; see the module docstring.

    hidden [M, H] (the drafter's final normed rows), latent [M, r], w2 [V, r] (``markov_w2.weight``),
    head_weight [V, H] (frozen), labels [M], teacher [M, H], row_weights [M]. With ``teacher_offsets`` (one more
    than the chunks of ``chunk_rows`` rows) ``teacher`` holds each chunk's distinct teacher rows instead, chunk
    ``c``'s at ``teacher[offsets[c]:offsets[c + 1]]``, and ``teacher_index`` [M] each row's among its chunk's
    (``objective.dspark_blocks.distinct_teacher_rows``): the teacher's logits are computed once per distinct
    row. ``loss`` carries the gradients
    of ``hidden``, ``latent`` and ``w2``; ``ce_sum`` and ``l1_sum`` are the weighted sums of each term (for
    the metrics), ``accept`` each row's ``clamp(1 - L1 / 2, 0, 1)``, ``correct`` whether the corrected
    logits' argmax is the label; those four are not differentiable. ``fused`` (default: on CUDA): each
    chunk's softmaxes, distances and gradients in one body (``dspark_chunk_terms_into``), compiled on CUDA and
    run as written on CPU; ``False``: the eager in-place loop. ``row_kernel`` (with ``fused``, on CUDA, for the
    logits ``dspark_row_kernel.takes``): each chunk's three passes in one Triton kernel that holds a row through
    them (``objective.dspark_row_kernel``) instead of the three compiled stages.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if (teacher_index is None) != (teacher_offsets is None):
        raise ValueError("teacher_index and teacher_offsets go together (distinct teacher rows per chunk)")
    if teacher_offsets is not None and len(teacher_offsets) != -(-hidden.shape[0] // chunk_rows) + 1:
        raise ValueError(f"teacher_offsets has {len(teacher_offsets)} entries for {hidden.shape[0]} rows in chunks of "
                         f"{chunk_rows}: the distinct teacher rows were cut for other chunks")
    return _DSparkHeadLoss.apply(hidden, latent, w2, head_weight.detach(), labels, teacher.detach(), row_weights,
                                 float(ce_weight), float(l1_weight), int(chunk_rows), float(multiplier), softcap,
                                 hidden.is_cuda if fused is None else bool(fused), teacher_index,
                                 None if teacher_offsets is None else tuple(teacher_offsets), bool(row_kernel))


@torch.no_grad()
def dspark_row_ce(hidden: torch.Tensor, latent: torch.Tensor, w2: torch.Tensor, head_weight: torch.Tensor,
                  labels: torch.Tensor, *, chunk_rows: int = CHUNK_ROWS, multiplier: float = 1.0,
                  softcap: float | None = None) -> torch.Tensor:
    """Each labelled row's cross-entropy of the Markov-corrected logits, ``logsumexp(z) - z[y]`` [M] (fp32; fp64 for an
    fp64 head), without gradients: the input of weights that depend on a whole block's rows (D-PACE,
    ``objective.dspark``), which the loss's chunks may split. A pass over the head before the loss's own, chunked as
    it is, through the same stage 1 (``chunk_stats``, compiled on CUDA, with no teacher), so the values are those the
    loss computes. On CUDA its chunk holds at most two [R, V] buffers in the head's dtype (4 bytes per logit in
    bf16, under the loss chunk's ``FUSED_BYTES_PER_LOGIT``), freed before the loss starts; its cost is the head's and
    the bias's matmuls again and one more read of the logits (not measured on CUDA)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    head = head_weight.detach()
    mm = head.dtype
    stats = _compiled_stages()[0] if hidden.is_cuda else chunk_stats
    ce = torch.empty(hidden.shape[0], dtype=torch.promote_types(mm, torch.float32), device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w2_mm = w2.detach().to(mm)
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            raw, bias = _logits_and_bias(hidden[start:end].detach(), latent[start:end].detach().to(mm), head, w2_mm,
                                         _unscaled(multiplier, softcap))
            ce[start:end] = stats(raw, bias, None, labels[start:end], multiplier, softcap)[2]
            del raw, bias
    return ce


def plain_dspark_head_loss(hidden, latent, w2, head_weight, labels, teacher, row_weights, *, ce_weight=0.1,
                           l1_weight=0.9, multiplier=1.0, softcap=None):
    """The same quantities with full logits materialised and autograd's gradients; the reference for tests."""
    dtype = torch.promote_types(head_weight.dtype, torch.float32)

    def scaled(x):
        logits = (x.to(head_weight.dtype) @ head_weight.t()).to(dtype) * multiplier
        return softcap * torch.tanh(logits / softcap) if softcap else logits

    z = scaled(hidden) + latent.to(dtype) @ w2.to(dtype).t()
    ce = torch.nn.functional.cross_entropy(z, labels, reduction="none")
    l1 = (torch.softmax(z, dim=-1) - torch.softmax(scaled(teacher.detach()), dim=-1)).abs().sum(-1)
    w = row_weights.to(dtype)
    ce_sum, l1_sum = (ce * w).sum(), (l1 * w).sum()
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    return ce_weight * ce_sum + l1_weight * l1_sum, ce_sum.detach(), l1_sum.detach(), accept, z.argmax(-1) == labels
