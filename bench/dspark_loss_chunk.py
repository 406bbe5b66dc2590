"""DSpark's loss chunks at the step's shape, on one GPU: the logits' two matmuls in either order, and the passes
over the logits in three compiled stages or in the row kernel.

    python bench/dspark_loss_chunk.py --json chunk.json

**The logits** (``--hidden``, ``--rank``): a chunk's z = h W^T + l W2^T in bf16, as the head's matmul first with
the bias added into its output (``addmm`` with the logits as the sum's input), or the bias first with the head's
matmul added into it (``dspark_head_loss._logits_and_bias``, the code the loss runs), or one matmul of [h | l] with
W and W2 side by side in one [V, H + r] buffer (a layout the loss does not have); each way's time and its z's largest
difference from the first's. Then the inputs' gradients from dz: dz W and dz W2 as two matmuls (the loss's), or
dz [W | W2] as one; and each of the backward's matmuls alone: dz W, dz W2 (few output tiles over a sum as long
as the vocabulary), dz W2 with that sum cut into slices of the vocabulary (one batched matmul, the slices' partial
results added in fp32), and W2's gradient dz^T l (in bf16; the loss adds it into an fp32 total).

**The passes**: the work of one DSpark step's head loss between its matmuls at the 8B shape (8,181 labelled rows in the
loss's chunks, ``DSparkLoss.chunk_rows`` unless ``--chunk-rows`` says otherwise; a 151,936 vocabulary, 16 slots per
anchor, 512 anchors in 3,072 tokens: each chunk's teacher rows are its distinct positions, about 0.37 of its rows), given bf16 logits: the compiled stages of
``objective.dspark_head_loss`` (and the teacher's log-normalisers) against ``objective.dspark_row_kernel`` at each
configuration of ``--blocks``, ``--programs`` (per multiprocessor) and ``--warps`` (the teacher's log-normalisers
taken before it, as the loss takes them). Each timed call starts from the
same logits (a copy, timed apart and taken off); each configuration's CE, L1, hits and gradients are compared with
the stages'. The bytes column counts one read of the student's logits and of the teacher's distinct rows and one
write of the gradient: the least a chunk must move.

**The teacher's log-normalisers** of every chunk's distinct rows: ``torch.logsumexp`` compiled (the loss's before
``dspark_row_kernel.rows_logsumexp``) against that kernel at each ``--lse-programs`` and ``--lse-warps``, with the
largest difference from ``torch.logsumexp`` in fp32 and the rate of one read.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from workloads import median_ms  # bench/ is on sys.path when run as a script

from draftline.objective import dspark_row_kernel
from draftline.objective.dspark import DSparkLoss
from draftline.objective.dspark_head_loss import _fused_terms, _logits_and_bias
from draftline.objective.head_loss import compile_over_rows


def _chunks(rows, chunk_rows, vocab, block_size, span, generator, device):
    """[(z, teacher's distinct rows, index, labels, weights)] of each chunk, in the order the loss takes them."""
    anchors = torch.randperm(span - block_size, generator=generator)[: -(-rows // block_size)].sort().values
    positions = (anchors[:, None] + torch.arange(block_size)).flatten()[:rows]
    chunks = []
    for start in range(0, rows, chunk_rows):
        distinct, index = positions[start:start + chunk_rows].unique(return_inverse=True)
        n = index.numel()
        z = (torch.randn(n, vocab, generator=generator) * 3).to(device=device, dtype=torch.bfloat16)
        teacher = (torch.randn(distinct.numel(), vocab, generator=generator) * 3).to(device=device,
                                                                                      dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n,), generator=generator).to(device)
        weights = torch.rand(n, generator=generator).to(device)
        chunks.append((z, teacher, index.to(device), labels, weights))
    return chunks


def _logits_orders(chunks, hidden, rank, reps, generator):
    """{order: ms} of forming every chunk's z = h W^T + l W2^T (bf16) in each order, and their largest difference."""
    vocab, device = chunks[0][0].shape[1], chunks[0][0].device
    head = (torch.randn(vocab, hidden, generator=generator) * 0.05).to(device, torch.bfloat16)
    w2 = (torch.randn(vocab, rank, generator=generator) * 0.05).to(device, torch.bfloat16)
    inputs = [(torch.randn(c[0].shape[0], hidden, generator=generator).to(device, torch.bfloat16),
               torch.randn(c[0].shape[0], rank, generator=generator).to(device, torch.bfloat16)) for c in chunks]
    scratch = [torch.empty_like(c[0]) for c in chunks]

    def head_first():
        for (h, latent), out in zip(inputs, scratch):
            torch.mm(h, head.t(), out=out)
            torch.addmm(out, latent, w2.t(), out=out)

    def bias_first():
        for i, (h, latent) in enumerate(inputs):
            scratch[i] = _logits_and_bias(h, latent, head, w2, True)[0]

    # W and W2 side by side in one [V, H + r] buffer (built once, as a head stored that way would be): z in one
    # matmul over [h | l], and the inputs' gradients [dh | dl] = dz [W | W2] in one.
    both = torch.cat([head, w2], dim=1)

    def one_matmul():
        for i, (h, latent) in enumerate(inputs):
            torch.mm(torch.cat([h, latent], dim=1), both.t(), out=scratch[i])

    apart = [(torch.empty_like(h), torch.empty_like(latent)) for h, latent in inputs]
    grads = [torch.empty(h.shape[0], hidden + rank, dtype=h.dtype, device=h.device) for h, _ in inputs]

    def grads_apart():
        for z, (dh, dl) in zip(scratch, apart):
            torch.mm(z, head, out=dh)
            torch.mm(z, w2, out=dl)

    def grads_at_once():
        for z, out in zip(scratch, grads):
            torch.mm(z, both, out=out)

    def dh_alone():
        for z, (dh, _) in zip(scratch, apart):
            torch.mm(z, head, out=dh)

    def dl_alone():
        for z, (_, dl) in zip(scratch, apart):
            torch.mm(z, w2, out=dl)

    # dz W2 has few output tiles ([R, r]) over a long sum (K = V): the sum cut into slices of the vocabulary, one
    # batched matmul over the slices, then their partial results added.
    slices = next(s for s in (8, 4, 2, 1) if vocab % s == 0)
    w2_sliced = w2.view(slices, vocab // slices, rank)
    dl_sum = torch.empty(max(z.shape[0] for z in scratch), rank, dtype=torch.float32, device=device)

    def dl_sliced():
        for z, (_, dl) in zip(scratch, apart):
            partial = torch.bmm(z.view(z.shape[0], slices, vocab // slices).transpose(0, 1), w2_sliced)
            torch.sum(partial, dim=0, dtype=torch.float32, out=dl_sum[: z.shape[0]])
            dl.copy_(dl_sum[: z.shape[0]])

    def dw2():  # a bf16 product: the loss adds it into an fp32 total in the matmul instead (_add_product)
        for z, (_, latent) in zip(scratch, inputs):
            torch.mm(z.t(), latent)

    times = {"head first, bias added": median_ms(head_first, reps), "bias first, head added": median_ms(bias_first, reps),
             "one matmul over [h | l] and [W | W2]": median_ms(one_matmul, reps)}
    zs = {}
    for name, fn in (("head first, bias added", head_first), ("bias first, head added", bias_first),
                     ("one matmul over [h | l] and [W | W2]", one_matmul)):
        fn()
        zs[name] = [z.float() for z in scratch]
    first = zs["head first, bias added"]
    worst = {name: max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(first, z)) for name, z in zs.items()}
    flops = sum(2 * h.shape[0] * vocab * (hidden + rank) for h, _ in inputs)
    for name, ms in times.items():
        print(f"  {name:40s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  largest difference from the first, "
              f"relative to the largest |z|: {worst[name]:.1e}")
    backward = {"dz W and dz W2 apart": median_ms(grads_apart, reps), "dz [W | W2] at once": median_ms(grads_at_once, reps)}
    for name, ms in backward.items():
        print(f"  the inputs' gradients, {name:27s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    rows = sum(h.shape[0] for h, _ in inputs)
    parts = {"dz W": (dh_alone, hidden), "dz W2": (dl_alone, rank),
             f"dz W2, the vocabulary in {slices} slices": (dl_sliced, rank),
             "dz^T l (W2's gradient, bf16)": (dw2, rank)}
    for name, (fn, width) in parts.items():
        backward[name] = ms = median_ms(fn, reps)
        print(f"  {name:40s} {ms:7.3f} ms  {2 * rows * vocab * width / ms / 1e9:6.1f} TFLOP/s")
    dl_sliced()
    sliced = [dl.float() for _, dl in apart]
    dl_alone()
    worst["dz W2 sliced against whole"] = max(((a - b.float()).abs().max() / b.float().abs().max()).item()
                                              for a, (_, b) in zip(sliced, apart))
    print(f"  dz W2 sliced against whole: largest difference {worst['dz W2 sliced against whole']:.1e} of the largest")
    del both, grads, apart
    return {"ms": times, "backward_ms": backward, "flops": flops, "max_relative_difference": worst}


def _teacher_normalisers(chunks, programs, warps, reps):
    """[{name, ms, TB/s, difference}] of the teacher's log-normalisers over every chunk, compiled and in the kernel."""
    teachers = [c[1] for c in chunks]
    want = [torch.logsumexp(t.float(), dim=-1) for t in teachers]
    read = sum(t.numel() * t.element_size() for t in teachers)
    compiled = compile_over_rows(lambda teacher: torch.logsumexp(teacher.float(), dim=-1))
    bodies = {"torch.logsumexp compiled": compiled}
    for p in programs:
        for w in warps:
            bodies[f"rows_logsumexp programs/SM {p} warps {w}"] = (
                lambda t, p=p, w=w: dspark_row_kernel.rows_logsumexp(t, programs_per_sm=p, num_warps=w))
    rows = []
    for name, body in bodies.items():
        ms = median_ms(lambda: [body(t) for t in teachers], reps)
        worst = max((body(t) - w).abs().max().item() for t, w in zip(teachers, want))
        rows.append({"name": name, "ms": round(ms, 3), "TB/s": round(read / ms / 1e9, 2), "difference": worst})
        print(f"  {name:40s} {ms:7.3f} ms  {read / ms / 1e9:5.2f} TB/s  difference {worst:.1e}", flush=True)
    return rows


def _run(body, chunks, scratch):
    outputs = []
    for (z, teacher, index, labels, weights), buffer in zip(chunks, scratch):
        buffer.copy_(z)
        ce, l1, hit = body(buffer, None, teacher, labels, weights, 0.1, 0.9, 1.0, None, True, index)
        outputs.append((ce, l1, hit, buffer))
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8181, help="labelled rows a step (default: %(default)s)")
    parser.add_argument("--chunk-rows", type=int, default=DSparkLoss.chunk_rows,
                        help="rows per loss chunk (default: the loss's, %(default)s; the reports before 2,048 became "
                             "the loss's default ran 1,024)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the logits' matmul (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=256, help="Markov rank (default: %(default)s)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192],
                        help="the kernel's columns per step of a pass (default: %(default)s)")
    parser.add_argument("--programs", type=float, nargs="+", default=[0.5, 1, 2],
                        help="the kernel's programs per multiprocessor (default: %(default)s)")
    parser.add_argument("--warps", type=int, nargs="+", default=[16, 32],
                        help="warps per program (default: %(default)s)")
    parser.add_argument("--lse-programs", type=float, nargs="+", default=[1, 2, 4],
                        help="the log-normaliser kernel's programs per multiprocessor (default: %(default)s)")
    parser.add_argument("--lse-warps", type=int, nargs="+", default=[8, 16, 32],
                        help="the log-normaliser kernel's warps per program (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions, median taken (default: %(default)s)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/dspark_loss_chunk.py needs a CUDA GPU", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    chunks = _chunks(args.rows, args.chunk_rows, args.vocab, 16, 3072, generator, "cuda")
    scratch = [torch.empty_like(c[0]) for c in chunks]
    copy_ms = median_ms(lambda: [b.copy_(c[0]) for c, b in zip(chunks, scratch)], args.reps)
    moved = sum(c[0].numel() * 4 + c[1].numel() * 2 for c in chunks)
    distinct = sum(c[1].shape[0] for c in chunks)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rows} rows in {len(chunks)} chunks, "
          f"{distinct} distinct teacher rows, V {args.vocab}; the copies {copy_ms:.2f} ms")

    print("the logits' two matmuls, every chunk:")
    orders = _logits_orders(chunks, args.hidden, args.rank, args.reps, generator)
    print("the teacher's log-normalisers, every chunk:")
    normalisers = _teacher_normalisers(chunks, args.lse_programs, args.lse_warps, args.reps)
    print("the passes over the logits, every chunk:")
    stages = _fused_terms()
    reference = [tuple(t.clone() for t in out) for out in _run(stages, chunks, scratch)]
    results = []

    def record(name, body, config):
        ms = median_ms(lambda: _run(body, chunks, scratch), args.reps) - copy_ms
        outputs = _run(body, chunks, scratch)
        worst = {"ce": 0.0, "l1": 0.0, "grad_rel": 0.0, "hits_differ": 0}
        for (ce, l1, hit, grad), (rce, rl1, rhit, rgrad) in zip(outputs, reference):
            worst["ce"] = max(worst["ce"], (ce - rce).abs().max().item())
            worst["l1"] = max(worst["l1"], (l1 - rl1).abs().max().item())
            worst["grad_rel"] = max(worst["grad_rel"], ((grad.float() - rgrad.float()).norm()
                                                        / rgrad.float().norm()).item())
            worst["hits_differ"] += int((hit != rhit).sum())
        row = {"name": name, **config, "ms": round(ms, 3), "TB/s": round(moved / ms / 1e9, 2), **worst}
        results.append(row)
        print(f"  {name:40s} {ms:7.3f} ms  {moved / ms / 1e9:5.2f} TB/s  ce {worst['ce']:.1e} l1 {worst['l1']:.1e} "
              f"grad {worst['grad_rel']:.1e} hits differ {worst['hits_differ']}", flush=True)

    record("three compiled stages", stages, {})
    for block in args.blocks:
        for programs in args.programs:
            for warps in args.warps:
                def body(*a, block=block, programs=programs, warps=warps):
                    return dspark_row_kernel.dspark_rows_into(*a, block=block, programs_per_sm=programs,
                                                              num_warps=warps)
                try:
                    record(f"rows block {block} programs/SM {programs} warps {warps}", body,
                           {"block": block, "programs_per_sm": programs, "warps": warps})
                except Exception as error:  # a configuration the compiler refuses (registers, shared memory)
                    print(f"  block {block} programs {programs} warps {warps}: {type(error).__name__}: {error}"[:300])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
                       "distinct_teacher_rows": distinct, "copy_ms": copy_ms, "logits": orders,
                       "teacher_normalisers": normalisers, "passes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
