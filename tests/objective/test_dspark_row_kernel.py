"""DSpark's row kernel against the compiled stages and the eager loop (CUDA), and what it refuses (CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import cuda_dspark_loss_inputs, cuda_dspark_loss_run

import draftline.objective.dspark_row_kernel as row_kernel
from draftline.objective.dspark_head_loss import _fused_terms, dspark_chunk_terms
from draftline.objective.dspark_row_kernel import dspark_rows_into, rows_logsumexp, takes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_it_takes_unscaled_half_precision_logits_only():
    assert takes(torch.bfloat16, 1.0, None) and takes(torch.float16, 1.0, None)
    assert not takes(torch.float32, 1.0, None)
    assert not takes(torch.bfloat16, 0.5, None)
    assert not takes(torch.bfloat16, 1.0, 30.0)


def test_it_refuses_what_it_does_not_take():
    """Refused before any Triton is imported: CPU logits, a bias apart, scaled logits."""
    raw = torch.zeros(2, 8, dtype=torch.bfloat16)
    labels, weights = torch.zeros(2, dtype=torch.long), torch.ones(2)
    for bias, multiplier, softcap in ((None, 1.0, None), (raw.clone(), 1.0, None), (None, 0.5, None),
                                      (None, 1.0, 30.0)):
        with pytest.raises(ValueError, match="row kernel"):
            dspark_rows_into(raw, bias, raw, labels, weights, 0.1, 0.9, multiplier, softcap, True)


@pytest.mark.parametrize("vocab,block,warps", [(151936, 8192, 32), (4096, 4096, 32), (3000, 2048, 32), (300, 256, 8),
                                               (64, 64, 2), (20, 16, 1)])
def test_a_program_never_has_more_threads_than_a_block_has_columns(monkeypatch, vocab, block, warps):
    """The third pass reads each column and writes its gradient over it, ordered only within one thread: both
    kernels launch with no more threads (32 a warp) than a block's columns, at the default 32 warps and any
    vocabulary (the launches recorded on CPU tensors taken for CUDA ones; nothing runs)."""
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append(options)

    monkeypatch.setattr(row_kernel, "_kernel", Launcher)
    monkeypatch.setattr(row_kernel, "_lse_kernel", Launcher)
    monkeypatch.setattr(row_kernel, "_multiprocessors", lambda index: 132)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    raw = torch.zeros(3, vocab, dtype=torch.bfloat16)
    labels, weights = torch.zeros(3, dtype=torch.long), torch.ones(3)
    dspark_rows_into(raw, None, raw, labels, weights, 0.1, 0.9, 1.0, None, True)
    assert [(options["BLOCK"], options["num_warps"]) for options in launches] == [(block, warps)] * 2


def _awkward_chunk(rows, vocab, distinct, dtype, generator):
    """Logits with the cases a pass can get wrong: a row with one finite logit, tied maxima with the label on the
    second, labels at both ends of the vocabulary; the teacher's rows picked by index."""
    one = min(77, vocab // 2)  # the column of the row with one finite logit
    z = torch.randn(rows, vocab, generator=generator) * 3
    z[1] = float("-inf")
    z[1, one] = 2.0
    z[2, [5, 9]] = z[2].max() + 4
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[0], labels[1], labels[2], labels[3] = 0, one, 9, vocab - 1
    z[3, vocab - 1] = z[3].max() + 1  # a hit at the last column
    teacher = torch.randn(distinct, vocab, generator=generator) * 3
    index = torch.randint(0, distinct, (rows,), generator=generator)
    weights = torch.rand(rows, generator=generator)
    return [t.cuda() for t in (z.to(dtype), teacher.to(dtype), labels, weights, index)]


def _check_against_the_stages(z, args, configurations, dtype):
    """Each configuration's CE, L1 and hits equal to the compiled stages' and the eager terms', its gradient within a
    rounding of the logits' dtype; without gradients the logits left as they were."""
    need_grad = args[7]
    staged = z.clone()
    s_ce, s_l1, s_hit = _fused_terms()(staged, None, *args)
    e_ce, e_l1, e_hit, _, e_grad = dspark_chunk_terms(z.clone(), None, *args)
    for options in configurations:
        mine = z.clone()
        ce, l1, hit = dspark_rows_into(mine, None, *args, **options)
        for got, want in ((ce, s_ce), (l1, s_l1), (ce, e_ce), (l1, e_l1)):
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(hit, s_hit) and torch.equal(hit, e_hit), options
        assert hit[1] and not hit[2] and hit[3]
        if not need_grad:
            assert torch.equal(mine, z)
            continue
        step = torch.finfo(dtype).eps * staged.float().abs()  # one rounding of each gradient entry
        assert ((mine.float() - staged.float()).abs() <= step + 1e-30).float().mean() > 0.999, options
        # rounded to nearest as the stages' are, not truncated: no farther from the fp32 gradient than theirs
        error = (mine.float() - e_grad).norm() / e_grad.norm()
        assert error <= 1.05 * (staged.float() - e_grad).norm() / e_grad.norm(), (error, options)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("need_grad", [True, False])
def test_the_row_kernel_equals_the_compiled_stages_and_the_eager_terms(dtype, indexed, need_grad):
    """1,030 rows at a real vocabulary (more rows than programs, and a vocabulary that no block divides), three
    configurations of the kernel (columns a step, programs, warps)."""
    rows, vocab = 1030, 151936
    z, teacher, labels, weights, index = _awkward_chunk(rows, vocab, 400, dtype, torch.Generator().manual_seed(3))
    if not indexed:
        teacher, index = teacher[index], None
    args = (teacher, labels, weights, 0.1, 0.9, 1.0, None, need_grad, index)
    _check_against_the_stages(z, args, [{}, dict(block=4096, programs_per_sm=2, num_warps=16),
                                        dict(block=2048, programs_per_sm=0.5, num_warps=8)], dtype)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [151936, 4096, 300])
def test_the_teachers_log_normalisers_in_one_read_equal_torchs(dtype, vocab):
    """``rows_logsumexp`` against ``torch.logsumexp`` in fp32: rows with -inf entries, one finite logit, none (-inf),
    a large offset; a view whose rows are farther apart than the vocabulary; several grids and warps."""
    generator = torch.Generator().manual_seed(5)
    wide = torch.randn(700, vocab + 64, generator=generator) * 4
    wide[0, : vocab // 2] = float("-inf")
    wide[1] = float("-inf")
    wide[1, vocab - 1] = 3.0
    wide[2] = float("-inf")
    wide[3] += 60.0
    logits = wide.to(dtype).cuda()[:, :vocab]
    want = torch.logsumexp(logits.float(), dim=-1)
    for options in ({}, dict(block=1024, programs_per_sm=1, num_warps=32), dict(block=4096, programs_per_sm=0.5,
                                                                                  num_warps=8)):
        got = rows_logsumexp(logits, **options)
        assert got.dtype == torch.float32 and got[2] == float("-inf"), options
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6, msg=lambda m: f"{options}: {m}")
    assert rows_logsumexp(logits[:0]).shape == (0,)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("vocab", [4096, 3000, 300, 64])
def test_the_row_kernel_at_vocabularies_a_block_divides_or_exceeds(vocab):
    """A vocabulary of whole blocks (no masked block), one with a partial block, and ones smaller than any block
    asked for (the block shrinks to fit it; at 64 columns, narrower than 32 warps' threads, the program takes fewer
    warps): every configuration equal to the stages."""
    z, teacher, labels, weights, index = _awkward_chunk(300, vocab, 40, torch.bfloat16,
                                                        torch.Generator().manual_seed(4))
    args = (teacher, labels, weights, 0.1, 0.9, 1.0, None, True, index)
    _check_against_the_stages(z, args, [dict(block=1024), dict(block=8192)], torch.bfloat16)


@pytest.mark.gpu
@cuda
def test_the_loss_with_the_row_kernel_equals_the_stages_and_allocates_no_more():
    """The whole head loss at an 8B-like chunking, row kernel on and off: the same loss, terms, acceptances, hits
    and gradients, and the row kernel's transient memory no larger than the stages' but for its per-row results
    (3,000 rows: a few KB a chunk; one [R, V] buffer more would be 0.29 GiB)."""
    inputs = cuda_dspark_loss_inputs(2, rows=3000)
    out = {}
    for row_kernel in (False, True, False, True):  # the first of each compiles; the second is measured
        out[row_kernel] = cuda_dspark_loss_run(inputs, chunk_rows=1024, row_kernel=row_kernel)
    stages, rows_kernel = out[False], out[True]
    for a, b in zip(stages[:4], rows_kernel[:4]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(stages[4], rows_kernel[4])
    for a, b in zip(stages[5], rows_kernel[5]):
        assert (b.float() - a.float()).norm() / a.float().norm() < 1e-2
    assert rows_kernel[6] <= stages[6] + 2**20, (rows_kernel[6], stages[6])
