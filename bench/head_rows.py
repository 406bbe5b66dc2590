"""The LM head's two matmuls at the row counts a loss chunk can have, on one GPU: whether a chunk's row count alone
changes cuBLAS's rate.

    python bench/head_rows.py --rows 1509 1510 1512 1536 2018 2048 --json rows.json

A head loss splits its labelled rows into chunks of a fixed size and a last chunk of what is left (the 8B DFlash step
of docs/benchmarks/2026-12-dspark-step.md: 7,653 rows, chunks of 2,048 and a last one of 1,509). Per row count R:
the forward ``h W^T`` ([R, H] x [H, V]) and the input's gradient ``dz W`` ([R, V] x [V, H]), bf16, as the head losses
run them (``objective.head_loss``), each timed alone (CUDA events, the median of ``--iters`` after a warm-up), with
its rate in TFLOP/s and its MFU against the GPU's spec dense bf16 peak (``sizing.peak``). The weight W is [V, H], the
8B target's (V = 151,936, H = 4,096) unless told otherwise.
"""

from __future__ import annotations

import argparse
import json

import torch
from workloads import median_ms  # bench/ is on sys.path when run as a script

from draftline.sizing.peak import known_peak, mfu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1509, 1510, 1512, 1536, 2018, 2048],
                        help="row counts of a chunk to time (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=4096, help="the head's input width H (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=151936, help="the vocabulary V (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per matmul (default: %(default)s)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    peak = known_peak(torch.cuda.get_device_name())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; W [{args.vocab}, {args.hidden}] bf16; "
          + (peak.describe() if peak else "no known peak: no MFU"))
    print(f"{'rows':>6} {'h W^T ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'dz W ms':>9} {'TFLOP/s':>8} {'MFU':>6}")
    results = []
    for rows in args.rows:
        h = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * rows * args.hidden * args.vocab
        forward = median_ms(lambda: h @ weight.t(), args.iters, warmup=2)
        backward = median_ms(lambda: dz @ weight, args.iters, warmup=2)
        shares = [mfu(flop, ms / 1e3, peak.flops) if peak else float("nan") for ms in (forward, backward)]
        results.append({"rows": rows, "forward_ms": forward, "backward_ms": backward,
                        "forward_tflops": flop / forward / 1e9, "backward_tflops": flop / backward / 1e9,
                        "forward_mfu": shares[0], "backward_mfu": shares[1]})
        print(f"{rows:6d} {forward:9.3f} {flop / forward / 1e9:8.0f} {shares[0]:6.1%} "
              f"{backward:9.3f} {flop / backward / 1e9:8.0f} {shares[1]:6.1%}")
        del h, dz
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": args.hidden,
                       "vocab": args.vocab, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
