"""DSpark's loss chunk in one Triton kernel: a program takes whole rows and passes over each three times.

The three compiled stages of ``objective.dspark_head_loss`` each read a chunk's ``[R, V]`` logits from device memory,
since a row's log-normaliser, then its L1 distance and ``<s, q>``, must be known before the next pass can start:
stage 1 reads the student's logits (and the teacher's distinct rows for their log-normalisers), stages 2 and 3 the
student's and the teacher's, and stage 3 writes the gradient. Here one program holds a row through its three passes,
so that the second and third can find in L2 what the first brought there: a persistent grid (``programs``
programs, each taking rows ``pid, pid + programs, ...``) bounds the rows in flight, and the second pass runs from
the row's end back to its start, where the first left off. How much they find there is not measured directly.

For a row with logits ``z`` (the Markov bias already added: unscaled heads only), the teacher's row ``t``, label
``y`` and weight ``w``, the arithmetic is ``dspark_head_loss.dspark_chunk_terms``' in fp32:

    before: lse_t over the chunk's distinct teacher rows, in one read (``rows_logsumexp``; the first pass need not
        read them)
    pass 1 (start to end): lse_z (online, in each lane: its running maximum and its exponentials' sum rescaled to it,
        brought together at the row's end), z[y], and the maxima of z over the row and over the columns before y (the
        hit test of ``head_loss.label_is_argmax``)
    pass 2 (end to start): L1 = sum |q - p|, <s, q> with q = exp(z - lse_z), p = exp(t - lse_t), s = sign(q - p)
    pass 3 (start to end): dz = w (q (ce_weight + l1_weight (s - <s, q>)) - ce_weight onehot(y)), over z in its
        dtype

Each pass takes whole blocks of ``block`` columns without a mask, then the row's last, partial block with one
(``objective.dspark_row_triton``, the kernel itself), and the exponentials are taken in base 2 (one FMA before each).

The defaults (8,192 columns a step, 32 warps, one program per multiprocessor) and lse_t before the kernel, rather
than in its first pass, were the fastest measured: 5.1 ms for the chunks of an 8B step against the stages' 8.7 on an
H100 (docs/benchmarks/2026-12-dspark-step.md, sections 12-13). Fewer programs were slower, not faster, and neither
loads a block ahead nor L2 eviction hints gained more. Only CUDA runs it (Triton); the tests compare it with the
compiled stages and the eager loop on the GPU.

A program never has more threads than a block has columns (``_geometry``), as a precaution: the third pass reads each
column and then writes its gradient over it, and Triton orders the two only within one thread. Where the block is
narrower than the program (a small vocabulary), a column would be held by threads of several warps, and one of them
could read it after another had written the gradient there. No GPU run has shown this happen; the cap changes only
vocabularies below 1,024 columns.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    from draftline.objective.dspark_row_triton import dspark_rows  # Triton: CUDA installs only

    return dspark_rows


@functools.cache
def _lse_kernel():
    from draftline.objective.dspark_row_triton import rows_logsumexp as kernel  # Triton: CUDA installs only

    return kernel


def rows_logsumexp(logits: torch.Tensor, *, block: int = 8192, programs_per_sm: float = 2,
                   num_warps: int = 32) -> torch.Tensor:
    """The log-normalisers [U] in fp32 of CUDA bf16 or fp16 logits [U, V] (unit stride along V), in one read: each
    program keeps its lanes' running maxima and sums over a row and brings them together at the row's end. The
    compiled ``torch.logsumexp`` it replaces read each row twice (its maximum, then its exponentials)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        programs, block, warps = _geometry(logits, block, programs_per_sm, num_warps)
        _lse_kernel()[(programs,)](logits, out, rows, logits.stride(0), VOCAB=vocab, BLOCK=block, num_warps=warps)
    return out


def _geometry(logits: torch.Tensor, block: int, programs_per_sm: float, num_warps: int) -> tuple[int, int, int]:
    """(programs, columns a step, warps a program) for rows of ``logits`` [R, V]: ``programs_per_sm`` programs per
    multiprocessor, no more than the rows; ``block`` columns, or the largest power of two within V where that is
    smaller (at least one whole block); ``num_warps``, or fewer where a program's threads (32 a warp) would
    outnumber a block's columns, so that each column is held by one thread alone (the module's docstring says why)."""
    rows, vocab = logits.shape
    programs = max(1, min(rows, int(programs_per_sm * _multiprocessors(logits.device.index or 0))))
    block = min(block, 1 << (vocab.bit_length() - 1))
    return programs, block, max(1, min(num_warps, block // 32))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def takes(dtype: torch.dtype, multiplier: float, softcap: float | None) -> bool:
    """Whether the kernel takes a head's logits: bf16 or fp16, unscaled (the Markov bias then added in the head's
    matmul). On CUDA only."""
    return dtype in (torch.bfloat16, torch.float16) and multiplier == 1.0 and not softcap


def dspark_rows_into(raw, bias, teacher_raw, labels, row_weights, ce_weight, l1_weight, multiplier, softcap,
                     need_grad, teacher_index=None, *, block: int = 8192, programs_per_sm: float = 1,
                     num_warps: int = 32):
    """(CE [R], L1 [R], correct [R]) of one chunk, with ``dz`` written over ``raw`` when ``need_grad``: the
    arguments and results of ``dspark_head_loss.dspark_chunk_terms_into``, for the logits ``takes`` accepts.

    ``raw`` [R, V] holds z (the head's unscaled logits with the Markov bias added), ``teacher_raw`` the teacher's
    logits ([R, V], or the chunk's distinct rows with ``teacher_index`` [R] picking each row's), both with unit
    stride along the vocabulary; ``row_weights`` [R] are the rows' weights, not yet normalised. ``block`` columns
    a step of each pass, ``programs_per_sm`` programs per multiprocessor (the rows in flight), ``num_warps`` a
    program's warps. The teacher rows' log-normalisers come from ``rows_logsumexp`` over its distinct rows, before
    the kernel."""
    if not (raw.is_cuda and bias is None and takes(raw.dtype, multiplier, softcap)):
        raise ValueError("the DSpark row kernel takes CUDA bf16 or fp16 logits, unscaled, with the Markov bias in them")
    if raw.stride(1) != 1 or teacher_raw.stride(1) != 1:
        raise ValueError("the logits must be contiguous along the vocabulary")
    rows, vocab = raw.shape
    ce = torch.empty(rows, dtype=torch.float32, device=raw.device)
    l1 = torch.empty_like(ce)
    hit = torch.empty(rows, dtype=torch.int8, device=raw.device)
    if rows:
        programs, block, warps = _geometry(raw, block, programs_per_sm, num_warps)
        index = labels if teacher_index is None else teacher_index  # any int tensor: unread without an index
        _kernel()[(programs,)](raw, teacher_raw, index, labels, row_weights.float(), rows_logsumexp(teacher_raw), ce,
                               l1, hit, rows, raw.stride(0), teacher_raw.stride(0), float(ce_weight), float(l1_weight),
                               VOCAB=vocab, BLOCK=block, HAS_INDEX=teacher_index is not None,
                               NEED_GRAD=bool(need_grad), num_warps=warps)
    return ce, l1, hit.bool()
