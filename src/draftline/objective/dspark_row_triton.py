"""The Triton kernel of ``objective.dspark_row_kernel`` (imported on CUDA only: Triton comes with CUDA builds of torch).

One program takes rows ``pid, pid + programs, ...`` and passes over each three times in blocks of ``BLOCK`` columns:
the whole blocks without a mask, then the row's last, partial block with one. The arithmetic, pass by pass, is in
``objective.dspark_row_kernel``'s docstring.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)): one FMA before ex2
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def load_row(row, idx, VOCAB: tl.constexpr, MASKED: tl.constexpr):
    """A block of a row's logits in fp32; past the vocabulary (``MASKED``: the row's last, partial block) -inf."""
    if MASKED:
        return tl.load(row + idx, mask=idx < VOCAB, other=NEG_INF).to(tl.float32)
    return tl.load(row + idx).to(tl.float32)


@triton.jit
def online_step(z, max_z, sum_z):
    """One block of z into each lane's running maximum and its sum of exponentials rescaled to it."""
    new_z = tl.maximum(max_z, z)
    # a maximum still -inf has no exponentials to rescale: exp(-inf - -inf) would be NaN
    return new_z, tl.where(new_z == NEG_INF, 0.0, sum_z * tl.exp2((max_z - new_z) * LOG2E) + tl.exp2((z - new_z) * LOG2E))


@triton.jit
def lanes_logsumexp(max_z, sum_z):
    """A row's log-normaliser and maximum from its lanes' running maxima and sums."""
    row_max = tl.max(max_z, 0)
    sum_z = tl.where(max_z == NEG_INF, 0.0, sum_z * tl.exp2((max_z - row_max) * LOG2E))
    return row_max + tl.log(tl.sum(sum_z, 0)), row_max


@triton.jit
def normaliser_step(z, idx, label, max_z, sum_z, before):
    """Pass 1 over one block of z: each lane's running maximum, its sum of exponentials rescaled to it, and the maxima
    of the columns before the label. No reduction across the program until the row's end."""
    max_z, sum_z = online_step(z, max_z, sum_z)
    return max_z, sum_z, tl.maximum(before, tl.where(idx < label, z, NEG_INF))


@triton.jit
def rows_logsumexp(t_ptr, out_ptr, rows, stride, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """The log-normalisers (fp32) of ``rows`` rows of logits in one read: a program takes rows ``pid, pid + programs,
    ...``, each in one pass of the online maximum and sum."""
    FULL: tl.constexpr = VOCAB // BLOCK
    TAIL: tl.constexpr = VOCAB % BLOCK != 0
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        t_row = t_ptr + tl.cast(row, tl.int64) * stride
        max_t = tl.full((BLOCK,), NEG_INF, tl.float32)
        sum_t = tl.zeros((BLOCK,), tl.float32)
        for block in range(FULL):
            max_t, sum_t = online_step(load_row(t_row, block * BLOCK + cols, VOCAB, False), max_t, sum_t)
        if TAIL:
            max_t, sum_t = online_step(load_row(t_row, FULL * BLOCK + cols, VOCAB, True), max_t, sum_t)
        lse, _ = lanes_logsumexp(max_t, sum_t)
        tl.store(out_ptr + row, lse)


@triton.jit
def q_and_difference(z, t, lse2_z, lse2_t):
    """(q, q - p) of one block of z and t (fp32), from the log-normalisers in base 2."""
    q = tl.exp2(z * LOG2E - lse2_z)
    return q, q - tl.exp2(t * LOG2E - lse2_t)


@triton.jit
def distance_step(z, t, lse2_z, lse2_t, l1_sum, sq_sum):
    """Pass 2 over one block: |q - p| and sign(q - p) q summed in each lane."""
    q, diff = q_and_difference(z, t, lse2_z, lse2_t)
    return l1_sum + tl.abs(diff), sq_sum + tl.where(diff > 0, q, tl.where(diff < 0, -q, 0.0))


@triton.jit
def gradient(z, t, idx, lse2_z, lse2_t, label, weight, sign_q, ce_weight, l1_weight):
    """Pass 3 over one block: the gradient of the row's weighted terms."""
    q, diff = q_and_difference(z, t, lse2_z, lse2_t)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    grad = q * (ce_weight + l1_weight * (sign - sign_q))
    return tl.where(idx == label, grad - ce_weight, grad) * weight


@triton.jit
def dspark_rows(z_ptr, t_ptr, index_ptr, labels_ptr, weights_ptr, lse_t_ptr, ce_ptr, l1_ptr, hit_ptr, rows,
                stride_z, stride_t, ce_weight, l1_weight, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
                HAS_INDEX: tl.constexpr, NEED_GRAD: tl.constexpr):
    FULL: tl.constexpr = VOCAB // BLOCK  # whole blocks (at least one); then one masked block if BLOCK does not divide
    TAIL: tl.constexpr = VOCAB % BLOCK != 0
    cols = tl.arange(0, BLOCK)
    tail = FULL * BLOCK + cols
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        z_row = z_ptr + tl.cast(row, tl.int64) * stride_z
        if HAS_INDEX:
            teacher = tl.load(index_ptr + row).to(tl.int64)
        else:
            teacher = tl.cast(row, tl.int64)
        t_row = t_ptr + teacher * stride_t
        label = tl.load(labels_ptr + row).to(tl.int32)
        picked = tl.load(z_row + label).to(tl.float32)

        # pass 1: the online log-normaliser of z; the maxima of the hit test
        max_z = tl.full((BLOCK,), NEG_INF, tl.float32)
        sum_z = tl.zeros((BLOCK,), tl.float32)
        before = tl.full((BLOCK,), NEG_INF, tl.float32)
        for block in range(FULL):
            idx = block * BLOCK + cols
            max_z, sum_z, before = normaliser_step(load_row(z_row, idx, VOCAB, False), idx, label, max_z, sum_z,
                                                   before)
        if TAIL:
            max_z, sum_z, before = normaliser_step(load_row(z_row, tail, VOCAB, True), tail, label, max_z, sum_z,
                                                   before)
        lse_z, row_max = lanes_logsumexp(max_z, sum_z)
        lse2_z = lse_z * LOG2E
        lse2_t = tl.load(lse_t_ptr + teacher) * LOG2E
        ce = lse_z - picked
        hit = (picked >= row_max) & ((label == 0) | (picked > tl.max(before, 0)))

        # pass 2, from the row's end: L1 and <s, q>
        l1_sum = tl.zeros((BLOCK,), tl.float32)
        sq_sum = tl.zeros((BLOCK,), tl.float32)
        if TAIL:
            l1_sum, sq_sum = distance_step(load_row(z_row, tail, VOCAB, True), load_row(t_row, tail, VOCAB, True),
                                           lse2_z, lse2_t, l1_sum, sq_sum)
        for back in range(FULL):
            idx = (FULL - 1 - back) * BLOCK + cols
            l1_sum, sq_sum = distance_step(load_row(z_row, idx, VOCAB, False), load_row(t_row, idx, VOCAB, False),
                                           lse2_z, lse2_t, l1_sum, sq_sum)
        l1 = tl.sum(l1_sum, 0)
        sign_q = tl.sum(sq_sum, 0)
        tl.store(ce_ptr + row, ce)
        tl.store(l1_ptr + row, l1)
        tl.store(hit_ptr + row, hit.to(tl.int8))

        # pass 3: the gradient, over z
        if NEED_GRAD:
            weight = tl.load(weights_ptr + row).to(tl.float32)
            for block in range(FULL):
                idx = block * BLOCK + cols
                grad = gradient(load_row(z_row, idx, VOCAB, False), load_row(t_row, idx, VOCAB, False), idx, lse2_z,
                                lse2_t, label, weight, sign_q, ce_weight, l1_weight)
                tl.store(z_row + idx, grad.to(z_ptr.dtype.element_ty))
            if TAIL:
                grad = gradient(load_row(z_row, tail, VOCAB, True), load_row(t_row, tail, VOCAB, True), tail, lse2_z,
                                lse2_t, label, weight, sign_q, ce_weight, l1_weight)
                tl.store(z_row + tail, grad.to(z_ptr.dtype.element_ty), mask=tail < VOCAB)
