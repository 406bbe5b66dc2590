"""The Triton kernel of ``objective.dspark_row_kernel`` (imported on CUDA only: Triton comes with CUDA builds of torch).

A team of ``TEAM`` programs takes rows ``team, team + teams, ...``; each member passes over its own slice of a row's
columns (``SLICE`` columns, the last member's cut at the vocabulary) three times, in blocks of ``BLOCK`` columns: the
whole blocks without a mask, then the slice's last, partial block with one. Between the passes the members hand each
other per-row numbers through ``part_ptr`` (six per member: the first pass's maximum, its sum of exponentials, its
maximum before the label and the label's logit, read before any member writes a gradient over it; the second pass's
L1 and ``<s, q>``) and wait for each other at a counter per row
(``count_ptr``, zeroed before the launch), which a cooperative launch makes safe: every program of the grid is
resident at once. The arithmetic, pass by pass, is in ``objective.dspark_row_kernel``'s docstring.

``FIRST`` and ``LAST`` choose the passes a launch runs: 1 to 3 in one launch, or each in a launch of its own (then no
member waits: the launches' order does it), which Triton's interpreter can run, since it runs one program at a time.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)): one FMA before ex2
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
PARTS: tl.constexpr = tl.constexpr(6)  # per member and row: max, sum, max before the label, L1, <s, q>, z[label]


@triton.jit
def load_row(row, idx, stop, MASKED: tl.constexpr):
    """A block of a row's logits in fp32; past ``stop`` (``MASKED``: the slice's last, partial block) -inf."""
    if MASKED:
        return tl.load(row + idx, mask=idx < stop, other=NEG_INF).to(tl.float32)
    return tl.load(row + idx).to(tl.float32)


@triton.jit
def normaliser_step(z, idx, label, max_z, sum_z, before):
    """Pass 1 over one block of z: each lane's running maximum, its sum of exponentials rescaled to it, and the maxima
    of the columns before the label. No reduction across the program until the slice's end."""
    new_z = tl.maximum(max_z, z)
    # a maximum still -inf has no exponentials to rescale: exp(-inf - -inf) would be NaN
    sum_z = tl.where(new_z == NEG_INF, 0.0, sum_z * tl.exp2((max_z - new_z) * LOG2E) + tl.exp2((z - new_z) * LOG2E))
    before = tl.maximum(before, tl.where(idx < label, z, NEG_INF))
    return new_z, sum_z, before


@triton.jit
def rescaled_sum(maxima, sums):
    """(the largest of ``maxima``, the sum of ``sums`` each rescaled from its maximum to it): lanes' or members'."""
    top = tl.max(maxima, 0)
    return top, tl.sum(tl.where(maxima == NEG_INF, 0.0, sums * tl.exp2((maxima - top) * LOG2E)), 0)


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
def wait_for_team(count, arrivals, TEAM: tl.constexpr):
    """Arrive at a row's counter and wait until ``arrivals`` members have (the members' stores before it published,
    theirs seen after it). One program alone only orders its own threads."""
    tl.debug_barrier()
    if TEAM > 1:
        seen = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") + 1
        while seen < arrivals:
            seen = tl.atomic_add(count, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def team_parts(part, which, TEAM: tl.constexpr):
    """Every member's entry ``which`` of a row's per-member numbers [TEAM], read past the L1 cache."""
    return tl.load(part + tl.arange(0, TEAM) * PARTS + which, volatile=True)


@triton.jit
def dspark_rows(z_ptr, t_ptr, index_ptr, labels_ptr, weights_ptr, lse_t_ptr, ce_ptr, l1_ptr, hit_ptr, part_ptr,
                count_ptr, rows, stride_z, stride_t, ce_weight, l1_weight, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
                TEAM: tl.constexpr, SLICE: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                HAS_INDEX: tl.constexpr, NEED_GRAD: tl.constexpr):
    member = tl.program_id(0) % TEAM
    teams = tl.num_programs(0) // TEAM
    start = member * SLICE
    stop = tl.maximum(tl.minimum(start + SLICE, VOCAB), start)
    whole = (stop - start) // BLOCK  # whole blocks of the slice; then one masked block if any column is left
    tail = start + whole * BLOCK + tl.arange(0, BLOCK)
    has_tail = start + whole * BLOCK < stop
    cols = start + tl.arange(0, BLOCK)
    for row in range(tl.program_id(0) // TEAM, rows, teams):
        z_row = z_ptr + tl.cast(row, tl.int64) * stride_z
        if HAS_INDEX:
            teacher = tl.load(index_ptr + row).to(tl.int64)
        else:
            teacher = tl.cast(row, tl.int64)
        t_row = t_ptr + teacher * stride_t
        label = tl.load(labels_ptr + row).to(tl.int32)
        part = part_ptr + tl.cast(row, tl.int64) * (TEAM * PARTS)
        mine = part + member * PARTS

        # pass 1 over the slice: the online log-normaliser of z; the maxima of the hit test
        if FIRST == 1:
            max_z = tl.full((BLOCK,), NEG_INF, tl.float32)
            sum_z = tl.zeros((BLOCK,), tl.float32)
            before = tl.full((BLOCK,), NEG_INF, tl.float32)
            for block in range(whole):
                idx = cols + block * BLOCK
                max_z, sum_z, before = normaliser_step(load_row(z_row, idx, stop, False), idx, label, max_z, sum_z,
                                                       before)
            if has_tail:
                max_z, sum_z, before = normaliser_step(load_row(z_row, tail, stop, True), tail, label, max_z, sum_z,
                                                       before)
            slice_max, slice_sum = rescaled_sum(max_z, sum_z)
            tl.store(mine, slice_max)
            tl.store(mine + 1, slice_sum)
            tl.store(mine + 2, tl.max(before, 0))
            tl.store(mine + 5, tl.load(z_row + label).to(tl.float32))
        if LAST >= 2:
            if FIRST == 1:
                wait_for_team(count_ptr + row, TEAM, TEAM)
            row_max, row_sum = rescaled_sum(team_parts(part, 0, TEAM), team_parts(part, 1, TEAM))
            lse_z = row_max + tl.log(row_sum)
            lse2_z = lse_z * LOG2E
            lse2_t = tl.load(lse_t_ptr + teacher) * LOG2E

            # pass 2 over the slice, from its end: L1 and <s, q>
            if FIRST <= 2:
                l1_sum = tl.zeros((BLOCK,), tl.float32)
                sq_sum = tl.zeros((BLOCK,), tl.float32)
                if has_tail:
                    l1_sum, sq_sum = distance_step(load_row(z_row, tail, stop, True),
                                                   load_row(t_row, tail, stop, True), lse2_z, lse2_t, l1_sum, sq_sum)
                for back in range(whole):
                    idx = cols + (whole - 1 - back) * BLOCK
                    l1_sum, sq_sum = distance_step(load_row(z_row, idx, stop, False),
                                                   load_row(t_row, idx, stop, False), lse2_z, lse2_t, l1_sum, sq_sum)
                tl.store(mine + 3, tl.sum(l1_sum, 0))
                tl.store(mine + 4, tl.sum(sq_sum, 0))
            if LAST == 3:
                if FIRST <= 2:
                    wait_for_team(count_ptr + row, 2 * TEAM, TEAM)
                sign_q = tl.sum(team_parts(part, 4, TEAM), 0)
                if member == 0:
                    picked = tl.load(part + 5, volatile=True)
                    tl.store(ce_ptr + row, lse_z - picked)
                    tl.store(l1_ptr + row, tl.sum(team_parts(part, 3, TEAM), 0))
                    hit = (picked >= row_max) & ((label == 0) | (picked > tl.max(team_parts(part, 2, TEAM), 0)))
                    tl.store(hit_ptr + row, hit.to(tl.int8))

                # pass 3 over the slice: the gradient, over z
                if NEED_GRAD:
                    weight = tl.load(weights_ptr + row).to(tl.float32)
                    for block in range(whole):
                        idx = cols + block * BLOCK
                        grad = gradient(load_row(z_row, idx, stop, False), load_row(t_row, idx, stop, False), idx,
                                        lse2_z, lse2_t, label, weight, sign_q, ce_weight, l1_weight)
                        tl.store(z_row + idx, grad.to(z_ptr.dtype.element_ty))
                    if has_tail:
                        grad = gradient(load_row(z_row, tail, stop, True), load_row(t_row, tail, stop, True), tail,
                                        lse2_z, lse2_t, label, weight, sign_q, ce_weight, l1_weight)
                        tl.store(z_row + tail, grad.to(z_ptr.dtype.element_ty), mask=tail < stop)
