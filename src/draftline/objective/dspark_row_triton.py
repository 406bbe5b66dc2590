"""The Triton kernel of ``objective.dspark_row_kernel`` (imported on CUDA only: Triton comes with CUDA builds of torch).

One program takes rows ``pid, pid + programs, ...`` and passes over each three times in blocks of ``BLOCK`` columns:
the whole blocks without a mask, then the row's last, partial block with one. With ``PREFETCH`` each pass loads its
next whole block before it works on the one in hand, so that a thread has two blocks' loads in flight. The arithmetic,
pass by pass, is in ``objective.dspark_row_kernel``'s docstring.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)): one FMA before ex2
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def load_row(row, idx, VOCAB: tl.constexpr, MASKED: tl.constexpr, KEEP: tl.constexpr):
    """A block of a row's logits in their dtype; past the vocabulary (``MASKED``: the row's last, partial block)
    -inf. ``KEEP``: L2's eviction hint ('evict_last' for a block read again, 'evict_first' for its last read)."""
    if MASKED:
        return tl.load(row + idx, mask=idx < VOCAB, other=NEG_INF, eviction_policy=KEEP)
    return tl.load(row + idx, eviction_policy=KEEP)


@triton.jit
def normaliser_step(z, idx, label, max_z, sum_z, before, LANES: tl.constexpr):
    """Pass 1 over one block of z (fp32): the running maximum (each lane's with ``LANES``, else the block's), the sum
    of exponentials rescaled to it, and the maxima of the columns before the label."""
    if LANES:
        new_z = tl.maximum(max_z, z)
    else:
        new_z = tl.maximum(max_z, tl.max(z, 0))
    # a maximum still -inf has no exponentials to rescale: exp(-inf - -inf) would be NaN
    sum_z = tl.where(new_z == NEG_INF, 0.0, sum_z * tl.exp2((max_z - new_z) * LOG2E) + tl.exp2((z - new_z) * LOG2E))
    before = tl.maximum(before, tl.where(idx < label, z, NEG_INF))
    return new_z, sum_z, before


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
                HAS_INDEX: tl.constexpr, NEED_GRAD: tl.constexpr, LANES: tl.constexpr, PREFETCH: tl.constexpr,
                EVICT: tl.constexpr):
    FULL: tl.constexpr = VOCAB // BLOCK  # whole blocks (at least one); then one masked block if BLOCK does not divide
    TAIL: tl.constexpr = VOCAB % BLOCK != 0
    cols = tl.arange(0, BLOCK)
    tail = FULL * BLOCK + cols
    AGAIN: tl.constexpr = "evict_last" if EVICT else ""  # the hints of the first two passes' loads
    LAST: tl.constexpr = "evict_first" if EVICT else ""  # and of the third's loads and stores
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
        if LANES:
            max_z = tl.full((BLOCK,), NEG_INF, tl.float32)
        else:
            max_z = tl.full([], NEG_INF, tl.float32)
        sum_z = tl.zeros((BLOCK,), tl.float32)
        before = tl.full((BLOCK,), NEG_INF, tl.float32)
        if PREFETCH:
            next_z = load_row(z_row, cols, VOCAB, False, AGAIN)
        for block in range(FULL):
            if PREFETCH:
                z = next_z
                next_z = load_row(z_row, tl.minimum(block + 1, FULL - 1) * BLOCK + cols, VOCAB, False, AGAIN)
            else:
                z = load_row(z_row, block * BLOCK + cols, VOCAB, False, AGAIN)
            max_z, sum_z, before = normaliser_step(z.to(tl.float32), block * BLOCK + cols, label, max_z, sum_z,
                                                   before, LANES)
        if TAIL:
            max_z, sum_z, before = normaliser_step(load_row(z_row, tail, VOCAB, True, AGAIN).to(tl.float32), tail, label,
                                                   max_z, sum_z, before, LANES)
        if LANES:
            row_max = tl.max(max_z, 0)
            sum_z = tl.where(max_z == NEG_INF, 0.0, sum_z * tl.exp2((max_z - row_max) * LOG2E))
        else:
            row_max = max_z
        lse_z = row_max + tl.log(tl.sum(sum_z, 0))
        lse2_z = lse_z * LOG2E
        lse2_t = tl.load(lse_t_ptr + teacher) * LOG2E
        ce = lse_z - picked
        hit = (picked >= row_max) & ((label == 0) | (picked > tl.max(before, 0)))

        # pass 2, from the row's end: L1 and <s, q>
        l1_sum = tl.zeros((BLOCK,), tl.float32)
        sq_sum = tl.zeros((BLOCK,), tl.float32)
        if TAIL:
            l1_sum, sq_sum = distance_step(load_row(z_row, tail, VOCAB, True, AGAIN).to(tl.float32),
                                           load_row(t_row, tail, VOCAB, True, AGAIN).to(tl.float32), lse2_z, lse2_t,
                                           l1_sum, sq_sum)
        if PREFETCH:
            next_z = load_row(z_row, (FULL - 1) * BLOCK + cols, VOCAB, False, AGAIN)
            next_t = load_row(t_row, (FULL - 1) * BLOCK + cols, VOCAB, False, AGAIN)
        for back in range(FULL):
            idx = (FULL - 1 - back) * BLOCK + cols
            if PREFETCH:
                z = next_z
                t = next_t
                ahead = tl.maximum(FULL - 2 - back, 0) * BLOCK + cols
                next_z = load_row(z_row, ahead, VOCAB, False, AGAIN)
                next_t = load_row(t_row, ahead, VOCAB, False, AGAIN)
            else:
                z = load_row(z_row, idx, VOCAB, False, AGAIN)
                t = load_row(t_row, idx, VOCAB, False, AGAIN)
            l1_sum, sq_sum = distance_step(z.to(tl.float32), t.to(tl.float32), lse2_z, lse2_t, l1_sum, sq_sum)
        l1 = tl.sum(l1_sum, 0)
        sign_q = tl.sum(sq_sum, 0)
        tl.store(ce_ptr + row, ce)
        tl.store(l1_ptr + row, l1)
        tl.store(hit_ptr + row, hit.to(tl.int8))

        # pass 3: the gradient, over z
        if NEED_GRAD:
            weight = tl.load(weights_ptr + row).to(tl.float32)
            if PREFETCH:
                next_z = load_row(z_row, cols, VOCAB, False, LAST)
                next_t = load_row(t_row, cols, VOCAB, False, LAST)
            for block in range(FULL):
                idx = block * BLOCK + cols
                if PREFETCH:
                    z = next_z
                    t = next_t
                    ahead = tl.minimum(block + 1, FULL - 1) * BLOCK + cols
                    next_z = load_row(z_row, ahead, VOCAB, False, LAST)
                    next_t = load_row(t_row, ahead, VOCAB, False, LAST)
                else:
                    z = load_row(z_row, idx, VOCAB, False, LAST)
                    t = load_row(t_row, idx, VOCAB, False, LAST)
                grad = gradient(z.to(tl.float32), t.to(tl.float32), idx, lse2_z, lse2_t, label, weight, sign_q,
                                ce_weight, l1_weight)
                tl.store(z_row + idx, grad.to(z_ptr.dtype.element_ty), eviction_policy=LAST)
            if TAIL:
                grad = gradient(load_row(z_row, tail, VOCAB, True, LAST).to(tl.float32),
                                load_row(t_row, tail, VOCAB, True, LAST).to(tl.float32), tail, lse2_z, lse2_t, label,
                                weight, sign_q, ce_weight, l1_weight)
                tl.store(z_row + tail, grad.to(z_ptr.dtype.element_ty), mask=tail < VOCAB, eviction_policy=LAST)
