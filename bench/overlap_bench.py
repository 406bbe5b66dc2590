"""Would the drafter's AdamW hide under the next step's matmuls? Time both alone, one after the other,
and at once on two streams (one GPU).

    python bench/overlap_bench.py            # the 8B drafter's parameter shapes, one H200

The update is the fused AdamW over fp32 parameters shaped like the 5-layer 8B drafter's (1.05B),
bandwidth-bound (~29 GB read and written); the matmuls are bf16 products shaped like a layer's
projections over 8,192 query rows, compute-bound. On a power-capped GPU the two compete for power as
well as for SMs, so the gain of running them at once is measured, not assumed: "saved" is
(update + matmuls) - (both at once). Each figure is a median of ``--iters`` timings, with the SM clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from draftline.monitor.clocks import ClockWatch

# One layer of the 8B-shaped drafter: q, o (4096 x 4096), k, v (1024 x 4096), gate, up, down (12288 x 4096).
LAYER_SHAPES = [(4096, 4096), (4096, 4096), (1024, 4096), (1024, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]


def make_update(layers: int, device: torch.device):
    shapes = LAYER_SHAPES * layers + [(4096, 5 * 4096)]  # + fc
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()  # the moments exist
    return optimizer, sum(p.numel() for p in params)


def make_matmuls(rows: int, device: torch.device, repeats: int):
    x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 12288, device=device, dtype=torch.bfloat16)

    def run():
        for _ in range(repeats):
            torch.mm(x, w)

    return run, 2 * rows * 4096 * 12288 * repeats


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=40, help="matmuls per timing (~1 ms each on an H200)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("overlap_bench needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    optimizer, numel = make_update(args.layers, device)
    matmuls, flops = make_matmuls(args.rows, device, args.repeats)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            optimizer.step()
        matmuls()
        torch.cuda.current_stream().wait_stream(side)

    for fn in (optimizer.step, matmuls, both):  # warm up
        timed(fn, 2)
    rows = []
    for name, fn in (("update alone", optimizer.step), ("matmuls alone", matmuls),
                     ("update then matmuls", lambda: (optimizer.step(), matmuls())), ("both at once", both)):
        with ClockWatch(device, period_s=0.02) as clock:
            seconds = timed(fn, args.iters)
        rows.append((name, seconds, clock.summary.text()))
    update, mm, serial, overlapped = (r[1] for r in rows)
    print(f"fused AdamW over {numel / 1e9:.2f}B fp32 parameters ({28 * numel / 1e9:.1f} GB moved); "
          f"{args.repeats} bf16 matmuls {args.rows} x 4096 x 12288 ({flops / 1e12:.1f} TFLOP)")
    print(f"{'':22s} {'ms':>8s}  note")
    for name, seconds, clock in rows:
        extra = (f"{28 * numel / seconds / 1e12:.2f} TB/s" if name == "update alone" else
                 f"{flops / seconds / 1e12:.0f} TFLOP/s" if name == "matmuls alone" else "")
        print(f"{name:22s} {1e3 * seconds:8.2f}  {extra}{'; ' if extra else ''}{clock}")
    print(f"saved by running them at once: {1e3 * (serial - overlapped):.2f} ms of the update's {1e3 * update:.2f} "
          f"({(serial - overlapped) / update:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
