"""The chunked LM head loss equals the plain computation, value and gradient."""

from __future__ import annotations

import pytest
import torch

from draftline.objective.head_loss import chunked_head_loss, plain_head_loss


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_chunked_equals_plain(chunk, multiplier, softcap):
    torch.manual_seed(0)
    h = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.float64)
    labels = torch.randint(0, 50, (13,))
    weights = torch.rand(13, dtype=torch.float64)
    loss, correct = chunked_head_loss(h, w, labels, weights, chunk_rows=chunk, multiplier=multiplier, softcap=softcap)
    (grad,) = torch.autograd.grad(loss * 2.5, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref, ref_correct = plain_head_loss(h2, w, labels, weights, multiplier=multiplier, softcap=softcap)
    (ref_grad,) = torch.autograd.grad(ref * 2.5, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
    assert torch.equal(correct, ref_correct)


def test_memory_grows_with_chunk_not_rows(monkeypatch):
    """At most chunk_rows rows of logits exist at once."""
    import draftline.objective.head_loss as hl

    seen = []
    original = hl._chunk_logits

    def spy(h, weight, multiplier, softcap):
        seen.append(h.shape[0])
        return original(h, weight, multiplier, softcap)

    monkeypatch.setattr(hl, "_chunk_logits", spy)
    h = torch.randn(100, 4, requires_grad=True)
    chunked_head_loss(h, torch.randn(30, 4), torch.randint(0, 30, (100,)), torch.ones(100), chunk_rows=16)
    assert max(seen) == 16 and sum(seen) == 100


@pytest.mark.parametrize("distill", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_hard_and_soft_labels_equal_plain_and_a_row_by_row_formula(distill, multiplier, softcap):
    """Soft labels (and hard, at 0): chunked == plain (value, gradient) == the mixed label row by row."""
    torch.manual_seed(1)
    h = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(11, 8, dtype=torch.float64)
    w = torch.randn(40, 8, dtype=torch.float64)
    labels = torch.randint(0, 40, (11,))
    weights = torch.rand(11, dtype=torch.float64)
    kw = dict(multiplier=multiplier, softcap=softcap, teacher=teacher, distill=distill)
    loss, correct = chunked_head_loss(h, w, labels, weights, chunk_rows=4, **kw)
    (grad,) = torch.autograd.grad(loss, h)
    h2 = h.detach().clone().requires_grad_(True)
    ref, ref_correct = plain_head_loss(h2, w, labels, weights, **kw)
    (ref_grad,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
    assert torch.equal(correct, ref_correct)

    # Independent: the mixed label written out, one row at a time.
    def logits_of(x):
        z = (x @ w.t()) * multiplier
        return torch.tanh(z / softcap) * softcap if softcap else z

    expected = 0.0
    for i in range(11):
        p = torch.softmax(logits_of(teacher[i]), -1)
        q = (1 - distill) * torch.nn.functional.one_hot(labels[i], 40).double() + distill * p
        expected += weights[i] * -(q * torch.log_softmax(logits_of(h[i].detach()), -1)).sum()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-9, atol=1e-9)


def test_soft_labels_at_the_teacher_distribution_have_zero_gradient():
    """distill=1 and the drafter's hidden equal to the teacher's: already optimal, gradient 0."""
    torch.manual_seed(2)
    teacher = torch.randn(6, 8)
    h = teacher.clone().requires_grad_(True)
    w = torch.randn(30, 8)
    loss, _ = chunked_head_loss(h, w, torch.randint(0, 30, (6,)), torch.ones(6), teacher=teacher, distill=1.0)
    (grad,) = torch.autograd.grad(loss, h)
    assert grad.abs().max() < 1e-5
    with pytest.raises(ValueError, match="teacher"):
        chunked_head_loss(h, w, torch.zeros(6, dtype=torch.long), torch.ones(6), distill=0.5)


@pytest.mark.parametrize("distill", [0.0, 0.5])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_functional_chunk_body_equals_plain(distill, multiplier, softcap):
    """The chunk body that CUDA compiles (run eagerly here) gives the plain loss, hits and gradient."""
    from draftline.objective.head_loss import loss_and_grad_of_logits

    torch.manual_seed(2)
    h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(9, 8, dtype=torch.float64)
    w = torch.randn(30, 8, dtype=torch.float64)
    labels = torch.randint(0, 30, (9,))
    weights = torch.rand(9, dtype=torch.float64)
    teacher_raw = teacher @ w.t() if distill > 0 else None
    loss, correct, grad_raw, ce = loss_and_grad_of_logits(h.detach() @ w.t(), labels, weights, multiplier, softcap,
                                                          teacher_raw, distill, True)
    ref, ref_correct = plain_head_loss(h, w, labels, weights, multiplier=multiplier, softcap=softcap,
                                       teacher=teacher if distill > 0 else None, distill=distill)
    (ref_grad,) = torch.autograd.grad(ref, h)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_raw @ w, ref_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close((ce * weights).sum(), ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(correct, ref_correct)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("distill,dpace", [(0.0, False), (0.5, False), (0.0, True)])
def test_compiled_head_loss_on_cuda_equals_eager(distill, dpace):
    """bf16 on CUDA: the compiled chunk body matches the eager in-place loop (loss, hits, gradient)."""
    torch.manual_seed(3)
    device = "cuda"
    h = torch.randn(3000, 256, device=device, requires_grad=True)
    teacher = torch.randn(3000, 256, device=device)
    w = (torch.randn(5000, 256, device=device) * 0.1).bfloat16()
    labels = torch.randint(0, 5000, (3000,), device=device)
    weights = torch.rand(3000, device=device)
    kw = dict(chunk_rows=1024, teacher=teacher if distill else None, distill=distill)
    if dpace:  # 3000 rows = 375 blocks of 8 labelled slots each
        from draftline.objective.dpace import dpace_weights

        rows = torch.arange(3000, device=device)
        kw["weigh"] = lambda ce: dpace_weights(ce, rows, 375, 8, 0.5)
    results = []
    for fused in (False, True):
        loss, correct = chunked_head_loss(h, w, labels, weights, fused=fused, **kw)
        (grad,) = torch.autograd.grad(loss, h)
        results.append((loss, correct, grad))
    (l0, c0, g0), (l1, c1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-3)
    assert (c0 != c1).float().mean() < 1e-3
    assert ((g1 - g0).norm() / g0.norm()) < 1e-2


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_label_is_argmax_where_argmax_says_so_ties_and_infinities_included(backend):
    """The hit test the compiled chunks take without ``argmax`` agrees with ``argmax(-1) == labels`` on every row:
    logits of a few distinct values (ties in most rows, the label on the first, a later or no maximum), labels at
    both ends of the vocabulary, rows of -inf and of +inf."""
    from draftline.objective.head_loss import label_is_argmax

    torch.manual_seed(11)
    rows, vocab = 4000, 13
    logits = torch.randint(-2, 3, (rows, vocab)).float()
    labels = torch.randint(0, vocab, (rows,))
    labels[:50], labels[50:100] = 0, vocab - 1
    logits[100:110] = float("-inf")
    logits[110:120, :3] = float("inf")
    labels[100:120:2] = 0
    top = logits.argmax(-1)
    labels[120:600] = top[120:600]  # the label on the first maximum
    ties = (logits == logits.amax(-1, keepdim=True)).sum(-1) > 1
    test = label_is_argmax if backend is None else torch.compile(label_is_argmax, backend=backend)
    hits = test(logits, labels)
    assert torch.equal(hits, top == labels)
    assert hits.any() and (~hits).any() and (ties & ~hits & (logits.gather(1, labels[:, None]).squeeze(1)
                                                            == logits.amax(-1))).any()  # a tie lost to an earlier max
    assert torch.equal(test(logits.bfloat16().float(), labels), top == labels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [8, 256, 2048])
def test_label_is_argmax_compiled_on_cuda_at_a_real_vocabulary(rows):
    """Compiled by Inductor over bf16 logits of a 151,936 vocabulary (few rows: the reduction split across blocks),
    the hit test still agrees with ``argmax``, on rows whose maximum is tied at two places."""
    from draftline.objective.head_loss import compile_over_rows, label_is_argmax

    torch.manual_seed(12)
    vocab = 151936
    logits = torch.randn(rows, vocab, device="cuda").bfloat16()
    top = logits.float().argmax(-1)
    second = (top + torch.randint(1, vocab, (rows,), device="cuda")) % vocab
    tied = torch.arange(rows, device="cuda") % 2 == 0
    logits[tied, second[tied]] = logits[tied, top[tied]]  # half the rows: the maximum at two places
    labels = torch.where(torch.arange(rows, device="cuda") % 4 < 2, torch.maximum(top, second), top)
    labels[1::8] = torch.randint(0, vocab, (len(labels[1::8]),), device="cuda")
    test = compile_over_rows(lambda z, y: label_is_argmax(z.float(), y))
    hits = test(logits, labels)
    expected = logits.float().argmax(-1) == labels
    assert torch.equal(hits, expected)
    assert hits.any() and (~hits).any()


@pytest.mark.parametrize("distill", [0.0, 0.5])
@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_gradient_written_over_the_logits_has_the_same_bits(distill, multiplier, softcap, backend):
    """The chunk body the compiled path runs writes the gradient over its logits; loss, hits, cross-entropies and
    gradient are bit for bit those of the body that returns a new gradient (bf16 logits, as on CUDA)."""
    from draftline.objective.head_loss import loss_and_grad_into_logits, loss_and_grad_of_logits

    torch.manual_seed(4)
    raw = (torch.randn(9, 40) * 3).bfloat16()
    teacher_raw = (torch.randn(9, 40) * 3).bfloat16() if distill > 0 else None
    labels = torch.randint(0, 40, (9,))
    weights = torch.rand(9)
    args = (labels, weights, multiplier, softcap, teacher_raw, distill)
    into = loss_and_grad_into_logits if backend is None else torch.compile(loss_and_grad_into_logits, backend=backend)
    loss, correct, grad, ce = loss_and_grad_of_logits(raw.clone(), *args, True)
    written = raw.clone()
    loss2, correct2, ce2 = into(written, *args, True)
    assert torch.equal(written, grad) and not torch.equal(written, raw)
    assert torch.equal(loss2, loss) and torch.equal(correct2, correct) and torch.equal(ce2, ce)
    untouched = raw.clone()
    into(untouched, *args, False)  # no gradient wanted: the logits stay as they were
    assert torch.equal(untouched, raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_head_loss_holds_one_chunk_of_logits_on_cuda():
    """The compiled chunk body writes its gradient over the chunk's logits: the head loss's transient memory is one
    [chunk, vocab] bf16 buffer and small change, not two."""
    torch.manual_seed(5)
    device = "cuda"
    rows, vocab, chunk = 4096, 50000, 1024
    h = torch.randn(rows, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, 256, device=device) * 0.1).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device=device)
    weights = torch.rand(rows, device=device)
    one_chunk = chunk * vocab * 2
    for measure in (False, True):  # the first call compiles
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss, _ = chunked_head_loss(h, w, labels, weights, chunk_rows=chunk)
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - before
        del loss
    assert one_chunk <= transient < 1.5 * one_chunk, (transient, one_chunk)


def test_compiled_over_rows_the_row_count_is_dynamic_and_the_vocabulary_static():
    """``compile_over_rows``: chunks of other row counts reuse one graph (no compile per chunk size), whose only
    symbolic sizes are the rows; the vocabulary stays a constant in it."""
    from draftline.objective.head_loss import compile_over_rows, loss_and_grad_into_logits

    graphs = []

    def backend(gm, inputs):
        graphs.append([i for i in inputs if not isinstance(i, torch.Tensor)])  # the symbolic sizes passed in
        return gm.forward

    torch._dynamo.reset()
    fn = compile_over_rows(loss_and_grad_into_logits, backend=backend)
    vocab = 37
    for rows in (9, 7, 5, 9):
        raw = torch.randn(rows, vocab).bfloat16()
        fn(raw, torch.randint(0, vocab, (rows,)), torch.rand(rows), 1.0, None, None, 0.0, True)
    assert len(graphs) == 1
    assert len(graphs[0]) == 1 and graphs[0][0] in (9, 7, 5)  # one symbolic size: the rows
