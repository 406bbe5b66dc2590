"""DSpark's chunked CE + L1 with gradients formed in the forward, against full logits and autograd."""

from __future__ import annotations

import pytest
import torch
from helpers import cuda_dspark_loss_inputs, cuda_dspark_loss_run

from draftline.objective.dspark_head_loss import dspark_head_loss, plain_dspark_head_loss


def _inputs(seed=0, rows=13, hidden=12, rank=5, vocab=37, dtype=torch.float64, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype) * scale  # noqa: E731
    return dict(
        hidden=rand(rows, hidden), latent=rand(rows, rank), w2=rand(vocab, rank), head_weight=rand(vocab, hidden),
        labels=torch.randint(0, vocab, (rows,), generator=gen), teacher=rand(rows, hidden),
        row_weights=torch.rand(rows, generator=gen, dtype=torch.float32) + 0.1,
    )


def _run(fn, inputs, **kwargs):
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden", "latent", "w2")}
    loss, ce, l1, accept, correct = fn(**{**inputs, **leaves}, **kwargs)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), ce, l1, accept, correct, grads


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("weights", [(0.1, 0.9), (1.0, 0.0), (0.0, 1.0), (0.3, 2.0)])
def test_loss_terms_and_gradients_equal_autograd(chunk, weights):
    inputs = _inputs(seed=chunk)
    ce_weight, l1_weight = weights
    ours = _run(dspark_head_loss, inputs, ce_weight=ce_weight, l1_weight=l1_weight, chunk_rows=chunk)
    ref = _run(plain_dspark_head_loss, inputs, ce_weight=ce_weight, l1_weight=l1_weight)
    for mine, theirs in zip(ours[:4], ref[:4]):
        torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-6, atol=1e-7)
    assert torch.equal(ours[4], ref[4])
    for mine, theirs in zip(ours[5], ref[5]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("multiplier,softcap", [(0.5, None), (1.0, 3.0), (2.0, 1.5)])
def test_output_multiplier_and_softcap(multiplier, softcap):
    inputs = _inputs(seed=7, scale=2.0)
    ours = _run(dspark_head_loss, inputs, chunk_rows=5, multiplier=multiplier, softcap=softcap)
    ref = _run(plain_dspark_head_loss, inputs, multiplier=multiplier, softcap=softcap)
    torch.testing.assert_close(ours[0].double(), ref[0].double(), rtol=1e-6, atol=1e-8)
    for mine, theirs in zip(ours[5], ref[5]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


def test_float32_and_a_bfloat16_head():
    inputs = _inputs(seed=3, dtype=torch.float32)
    ours = _run(dspark_head_loss, inputs, chunk_rows=3)
    ref = _run(plain_dspark_head_loss, inputs)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(ours[5], ref[5]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    # A bf16 head (the pipeline's frozen head) runs its matmuls in bf16 and the rest in fp32; gradients keep
    # their leaves' dtypes.
    low = dict(inputs, head_weight=inputs["head_weight"].bfloat16(), hidden=inputs["hidden"].bfloat16())
    loss, *_, grads = _run(dspark_head_loss, low, chunk_rows=4)
    assert torch.isfinite(loss) and grads[0].dtype == torch.bfloat16 and grads[2].dtype == torch.float32
    torch.testing.assert_close(loss, ref[0], rtol=0.05, atol=0.05)


def test_identical_distributions_give_no_l1_and_full_acceptance():
    """With the drafter's corrected logits equal to the teacher's (no Markov bias, same hidden state), L1 is 0,
    acceptance 1 and the L1 term adds no gradient (sign(0) = 0, as autograd's abs)."""
    inputs = _inputs(seed=5)
    inputs["teacher"] = inputs["hidden"].clone()
    inputs["latent"] = torch.zeros_like(inputs["latent"])
    loss, ce, l1, accept, _, grads = _run(dspark_head_loss, inputs, ce_weight=0.0, l1_weight=1.0, chunk_rows=4)
    assert float(l1) < 1e-12 and torch.allclose(accept, torch.ones_like(accept))
    assert all(float(g.abs().max()) < 1e-12 for g in grads)


def test_memory_is_bounded_by_the_chunk():
    """Nothing of [rows, vocab] survives the call: backward holds [rows, H], [rows, r] and [V, r] only."""
    inputs = _inputs(rows=64, vocab=500, dtype=torch.float32)
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden", "latent", "w2")}
    loss, *_ = dspark_head_loss(**{**inputs, **leaves}, chunk_rows=8)
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert sorted(tuple(t.shape) for t in saved) == sorted([(64, 12), (64, 5), (500, 5)])


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, None), (2.0, 1.5)])
@pytest.mark.parametrize("weights", [(0.1, 0.9), (1.0, 0.0), (0.0, 1.0)])
def test_the_chunk_body_cuda_compiles_equals_autograd(multiplier, softcap, weights):
    """The buffer path (the body CUDA compiles, run as written here) gives the plain loss, terms and gradients."""
    inputs = _inputs(seed=11, scale=2.0)
    ce_weight, l1_weight = weights
    kw = dict(ce_weight=ce_weight, l1_weight=l1_weight, multiplier=multiplier, softcap=softcap)
    ours = _run(dspark_head_loss, inputs, chunk_rows=4, fused=True, **kw)
    ref = _run(plain_dspark_head_loss, inputs, **kw)
    for mine, theirs in zip(ours[:4], ref[:4]):
        torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-6, atol=1e-7)
    assert torch.equal(ours[4], ref[4])
    for mine, theirs in zip(ours[5], ref[5]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_gradients_written_over_the_buffers_have_the_same_bits(multiplier, softcap, backend):
    """The compiled path's body writes dz over the Markov bias and the raw logits' gradient over the logits; the
    terms and both gradients are bit for bit those of the body that returns them (bf16 buffers, as on CUDA)."""
    from draftline.objective.dspark_head_loss import dspark_chunk_terms, dspark_chunk_terms_into

    torch.manual_seed(4)
    raw, bias, teacher_raw = ((torch.randn(9, 40) * 3).bfloat16() for _ in range(3))
    labels, weights = torch.randint(0, 40, (9,)), torch.rand(9)
    args = (labels, weights, 0.1, 0.9, multiplier, softcap)
    into = dspark_chunk_terms_into if backend is None else torch.compile(dspark_chunk_terms_into, backend=backend)
    ce, l1, correct, grad_z, grad_raw = dspark_chunk_terms(raw, bias, teacher_raw, *args, True)
    raw2, bias2 = raw.clone(), bias.clone()
    ce2, l12, correct2 = into(raw2, bias2, teacher_raw, *args, True)
    assert torch.equal(bias2, grad_z.to(bias.dtype)) and torch.equal(raw2, grad_raw.to(raw.dtype))
    assert torch.equal(ce2, ce) and torch.equal(l12, l1) and torch.equal(correct2, correct)
    raw3, bias3 = raw.clone(), bias.clone()
    into(raw3, bias3, teacher_raw, *args, False)  # no gradient wanted: the buffers stay as they were
    assert torch.equal(raw3, raw) and torch.equal(bias3, bias)


@pytest.mark.parametrize("teacher_index", [None, torch.tensor([0, 2, 1, 1, 0, 2, 2, 0, 1])],
                         ids=["per-row", "distinct"])
def test_the_bias_folded_into_unscaled_logits_gives_the_same_terms_and_one_gradient(teacher_index):
    """Unscaled logits take the Markov bias in the head's matmul (``bias`` None, ``raw`` = z): the terms are bit for
    bit those of the bias apart (fp32 buffers, where adding it first is the same sum), and the one gradient written
    over ``raw`` is ``dz``, which is then also the raw logits' gradient."""
    from draftline.objective.dspark_head_loss import dspark_chunk_terms, dspark_chunk_terms_into

    torch.manual_seed(7)
    raw, bias = (torch.randn(9, 40) * 3 for _ in range(2))
    teacher_raw = torch.randn(9 if teacher_index is None else 3, 40) * 3
    args = (torch.randint(0, 40, (9,)), torch.rand(9), 0.1, 0.9, 1.0, None, True, teacher_index)
    ce, l1, correct, grad_z, grad_raw = dspark_chunk_terms(raw, bias, teacher_raw, *args)
    folded = raw + bias
    ce2, l12, correct2 = dspark_chunk_terms_into(folded, None, teacher_raw, *args)
    assert torch.equal(ce2, ce) and torch.equal(l12, l1) and torch.equal(correct2, correct)
    assert torch.equal(folded, grad_z) and torch.equal(grad_z, grad_raw)


def test_the_bias_is_not_folded_into_scaled_logits():
    """A multiplier or a softcap comes before the bias: a caller that folded it anyway is refused."""
    from draftline.objective.dspark_head_loss import dspark_chunk_terms_into

    raw, teacher_raw = torch.randn(3, 8), torch.randn(3, 8)
    for multiplier, softcap in ((0.5, None), (1.0, 30.0)):
        with pytest.raises(ValueError, match="not scaled"):
            dspark_chunk_terms_into(raw, None, teacher_raw, torch.zeros(3, dtype=torch.long), torch.ones(3), 0.1, 0.9,
                                    multiplier, softcap, True)


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_a_bf16_head_forms_z_as_the_compiled_path_does(multiplier, softcap):
    """With a bf16 head (training's dtype) the eager loop and the chunk body form the same z, unscaled (the bias in
    the head's matmul, rounded once) or scaled (the bias apart, in fp32): same hits, terms within fp32 summation
    order."""
    inputs = _inputs(seed=3, rows=11, hidden=16, rank=4, vocab=300, dtype=torch.float32, scale=1.5)
    inputs["head_weight"] = inputs["head_weight"].bfloat16()
    kw = dict(chunk_rows=4, multiplier=multiplier, softcap=softcap)
    eager = _run(dspark_head_loss, inputs, fused=False, **kw)
    body = _run(dspark_head_loss, inputs, fused=True, **kw)
    assert torch.equal(eager[4], body[4])
    for mine, theirs in zip(body[:4], eager[:4]):  # L1 sums ~300 terms near 2 in total: a few fp32 steps of 2.4e-7
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=4e-6)
    for mine, theirs in zip(body[5], eager[5]):
        torch.testing.assert_close(mine, theirs, rtol=1e-2, atol=1e-4)


def test_each_stage_compiled_apart_gives_the_same_bits():
    """CUDA compiles the three stages apart (``_fused_terms``); compiled so with aot_eager here, the chunk's terms
    and the gradients written over its buffers are bit for bit the uncompiled body's."""
    import functools

    from draftline.objective import dspark_head_loss as module

    torch.manual_seed(5)
    raw, bias, teacher_raw = ((torch.randn(7, 33) * 3).bfloat16() for _ in range(3))
    args = (torch.randint(0, 33, (7,)), torch.rand(7), 0.1, 0.9, 0.5, 3.0, True)
    staged = functools.partial(module.dspark_chunk_terms_into,
                               stages=tuple(torch.compile(s, backend="aot_eager") for s in module._STAGES))
    buffers = [(raw.clone(), bias.clone()) for _ in range(2)]
    plain = module.dspark_chunk_terms_into(*buffers[0], teacher_raw, *args)
    compiled = staged(*buffers[1], teacher_raw, *args)
    assert all(torch.equal(a, b) for a, b in zip(plain, compiled))
    assert all(torch.equal(a, b) for a, b in zip(buffers[0], buffers[1]))
    assert not torch.equal(buffers[0][0], raw)  # the gradient was written


def _shared_teachers(inputs, chunk, seed=0):
    """``inputs`` whose rows read teachers that overlapping blocks share: each row's teacher drawn from a few
    tokens; (per-row inputs, the same with each chunk's distinct teacher rows and each row's index among them)."""
    from draftline.objective.dspark_blocks import distinct_teacher_rows

    rows = inputs["hidden"].shape[0]
    tokens = torch.randn(6, inputs["teacher"].shape[1], generator=torch.Generator().manual_seed(seed),
                         dtype=inputs["teacher"].dtype)
    teacher_rows = torch.randint(0, 6, (rows,), generator=torch.Generator().manual_seed(seed + 1))
    per_row = dict(inputs, teacher=tokens[teacher_rows])
    distinct = distinct_teacher_rows(teacher_rows, chunk)
    assert distinct.rows.numel() < rows or chunk == 1  # some rows of a chunk share a teacher
    return per_row, dict(inputs, teacher=tokens[distinct.rows], teacher_index=distinct.index,
                         teacher_offsets=distinct.offsets)


@pytest.mark.parametrize("fused", [False, True], ids=["eager-loop", "chunk-body"])
@pytest.mark.parametrize("chunk", [1, 4, 5, 100])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (2.0, 1.5)])
def test_distinct_teacher_rows_give_the_loss_of_a_teacher_per_row(fused, chunk, multiplier, softcap):
    """Each chunk's teacher logits computed once per distinct teacher row, then read by index: the loss, terms and
    gradients of the per-row teacher, and of the full-logits reference."""
    per_row, distinct = _shared_teachers(_inputs(seed=chunk, scale=2.0), chunk)
    kw = dict(chunk_rows=chunk, fused=fused, multiplier=multiplier, softcap=softcap)
    ours = _run(dspark_head_loss, distinct, **kw)
    rows = _run(dspark_head_loss, per_row, **kw)
    ref = _run(plain_dspark_head_loss, per_row, multiplier=multiplier, softcap=softcap)
    for expected in (rows, ref):
        for mine, theirs in zip(ours[:4], expected[:4]):
            torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-6, atol=1e-7)
        assert torch.equal(ours[4], expected[4])
        for mine, theirs in zip(ours[5], expected[5]):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


def test_distinct_teacher_rows_compiled_stages_give_the_same_bits():
    """The stages compiled apart (aot_eager here) read each row's teacher by index as the uncompiled body does."""
    import functools

    from draftline.objective import dspark_head_loss as module

    torch.manual_seed(6)
    raw, bias = ((torch.randn(7, 33) * 3).bfloat16() for _ in range(2))
    teacher_raw, pick = (torch.randn(3, 33) * 3).bfloat16(), torch.tensor([0, 0, 1, 2, 1, 2, 2])
    args = (torch.randint(0, 33, (7,)), torch.rand(7), 0.1, 0.9, 1.0, None, True, pick)
    staged = functools.partial(module.dspark_chunk_terms_into,
                               stages=tuple(torch.compile(s, backend="aot_eager") for s in module._STAGES))
    buffers = [(raw.clone(), bias.clone()) for _ in range(3)]
    plain = module.dspark_chunk_terms_into(*buffers[0], teacher_raw, *args)
    compiled = staged(*buffers[1], teacher_raw, *args)
    per_row = module.dspark_chunk_terms_into(*buffers[2], teacher_raw[pick], *args[:-1])
    for other in (compiled, per_row):
        assert all(torch.equal(a, b) for a, b in zip(plain, other))
    assert all(torch.equal(a, b) for a, b in zip(buffers[0], buffers[1]))
    assert all(torch.equal(a, b) for a, b in zip(buffers[0], buffers[2]))


def test_teacher_offsets_cut_for_other_chunks_are_refused():
    per_row, distinct = _shared_teachers(_inputs(), 4)
    with pytest.raises(ValueError, match="cut for other chunks"):
        dspark_head_loss(**distinct, chunk_rows=5)
    with pytest.raises(ValueError, match="go together"):
        dspark_head_loss(**dict(distinct, teacher_index=None), chunk_rows=4)


def test_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match="chunk_rows"):
        dspark_head_loss(**_inputs(), chunk_rows=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_per_chunk_on_cuda_at_an_8b_shape():
    """8B shape (H 4096, V 151,936), 8,192 labelled rows, rank 256, bf16 head and rows, chunks of 1,024: the
    call's peak above its inputs stays within 3 x chunk x V x 4 bytes plus the gradients it returns, and the
    loss equals an fp32 run's within bf16's error."""
    torch.manual_seed(0)
    device, rows, hidden, vocab, rank, chunk = "cuda", 8192, 4096, 151936, 256, 1024
    head = (torch.randn(vocab, hidden, device=device) * 0.02).bfloat16()
    h = torch.randn(rows, hidden, device=device).bfloat16().requires_grad_(True)
    teacher = torch.randn(rows, hidden, device=device).bfloat16()
    latent = (torch.randn(rows, rank, device=device) * 0.02).requires_grad_(True)
    w2 = (torch.randn(vocab, rank, device=device) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device=device)
    weights = torch.rand(rows, device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, *_ = dspark_head_loss(h, latent, w2, head, labels, teacher, weights, chunk_rows=chunk)
    grads = torch.autograd.grad(loss, [h, latent, w2])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    returned = rows * hidden * 2 + rows * rank * 4 + 2 * vocab * rank * 4  # grad_h, grad_latent, grad_w2 (+ fp32 sum)
    bound = 3 * chunk * vocab * 4 + returned
    print(f"peak {peak / 2**30:.2f} GiB, bound {bound / 2**30:.2f} GiB")
    assert peak <= 1.1 * bound, (peak, bound)
    ref, *_ = dspark_head_loss(h.float(), latent, w2, head.float(), labels, teacher.float(), weights, chunk_rows=chunk)
    torch.testing.assert_close(loss.float(), ref, rtol=2e-2, atol=0)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 30.0)])
def test_compiled_chunks_on_cuda_equal_the_eager_loop(multiplier, softcap):
    """bf16 on CUDA at a real vocabulary: the compiled chunks give the eager loop's loss, terms, acceptances, hits
    and gradients within bf16's error, and their transient memory stays within ``FUSED_BYTES_PER_LOGIT`` a row
    and vocabulary entry plus the gradients returned, softcap or not."""
    from draftline.objective.dspark_head_loss import FUSED_BYTES_PER_LOGIT

    rows, hidden, vocab, rank, chunk = 4096, 1024, 151936, 256, 1024
    inputs = cuda_dspark_loss_inputs(1, rows, hidden, vocab, rank)
    out = {}
    for fused in (False, True, True):  # the first compiled call compiles; the second is measured
        out[fused] = cuda_dspark_loss_run(inputs, chunk_rows=chunk, multiplier=multiplier, softcap=softcap, fused=fused)
    eager, compiled = out[False], out[True]
    for a, b in zip(eager[:4], compiled[:4]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    assert (eager[4] != compiled[4]).float().mean() < 1e-3
    for a, b in zip(eager[5], compiled[5]):
        assert ((b.float() - a.float()).norm() / a.float().norm()) < 2e-2
    returned = rows * hidden * 2 + rows * rank * 4 + 2 * vocab * rank * 4
    bound = FUSED_BYTES_PER_LOGIT * chunk * vocab + returned
    print(f"compiled transient {compiled[6] / 2**30:.2f} GiB (eager {eager[6] / 2**30:.2f}), bound {bound / 2**30:.2f}")
    assert compiled[6] <= 1.1 * bound and compiled[6] < eager[6], (compiled[6], bound, eager[6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_w2_gradient_is_summed_over_chunks_in_fp32_on_cuda():
    """W2's gradient, summed over chunks by ``_add_product`` (cuBLAS's fp32 accumulator on CUDA), is nearer the exact
    sum than products rounded to bf16 and then added, and stays in the tensor it was given."""
    from draftline.objective.dspark_head_loss import _add_product

    torch.manual_seed(2)
    vocab, rank, rows, chunks = 4096, 256, 1024, 8
    grads = [torch.randn(rows, vocab, device="cuda").bfloat16() for _ in range(chunks)]
    latents = [torch.randn(rows, rank, device="cuda").bfloat16() for _ in range(chunks)]
    exact = sum(g.double().t() @ lat.double() for g, lat in zip(grads, latents))
    total = torch.zeros(vocab, rank, device="cuda")
    rounded = torch.zeros_like(total)
    pointer = total.data_ptr()
    for g, lat in zip(grads, latents):
        _add_product(total, g.t(), lat)
        rounded += g.t() @ lat
    assert total.data_ptr() == pointer and total.dtype == torch.float32
    error = lambda t: ((t.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    print(f"relative error: fp32 sum {error(total):.2e}, bf16 products {error(rounded):.2e}")
    assert error(total) < 1e-5 < error(rounded)
