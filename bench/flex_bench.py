"""Time the drafter's masked attention alone (flex, one layer, forward + backward) under kernel options.

    python bench/flex_bench.py --variants default,static,bwd64 --lengths 3072

The layout is the bench's: documents of ``--lengths`` tokens, 512 anchors each, block 16, the
8B shape (32 query heads, 8 KV heads, head_dim 128), bf16. FLOPs as docs/FLOPS.md counts them
(visible pairs only), so TFLOP/s here is comparable with the step's attention share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import packed_batch  # noqa: E402

from draftline.model.attention import FlexAttention, flex_compile_shapes  # noqa: E402
from draftline.sizing.flops import _drafter_pairs, attention_flops  # noqa: E402
from draftline.sizing.shapes import FULL, LayerShape  # noqa: E402
from draftline.objective.anchors import sample_anchors  # noqa: E402
from draftline.objective.blocks import build_blocks  # noqa: E402

VARIANTS = {  # kernel options ("fwd_"/"bwd_" prefixes apply to one pass only); "autotune": inductor's search
    "default": {},
    "safe_rows": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "bwd64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4,
              "bwd_num_stages": 3},
    "bwd32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_warps": 4,
              "bwd_num_stages": 3},
    "fwd128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "tuned": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 1,
              "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_warps": 4,
              "bwd_num_stages": 3},  # what max-autotune chose on an H200 (docs/PERF_NOTES.md)
    "autotune": {},
    "flash": {"BACKEND": "FLASH"},  # FlashAttention-4's CuTe DSL kernels (needs flash-attn-4 installed)
    "flash_static": {"BACKEND": "FLASH"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="default,static,tma,bwd64,bwd32,autotune")
    parser.add_argument("--lengths", default="3072", help="comma-separated document lengths of one pass")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    lengths = [int(n) for n in args.lengths.split(",")]
    batch = packed_batch(lengths, 151936, 0, 0)
    blocks = build_blocks(batch, sample_anchors(batch, 512, 0), block_size=16, mask_token_id=151669, gamma=7.0)
    pairs = _drafter_pairs(blocks.layout.anchor_pos.double(), 16, LayerShape(FULL, 0, 0, 32, 8, 128))
    flops = attention_flops(pairs, 32, 128, backward=True)
    layout = blocks.layout.to(device)
    q_rows, kv_rows = layout.num_queries, layout.num_context + layout.num_queries
    results = []
    reference = None  # the first variant's output and gradients: every other is compared with it
    for name in args.variants.split(","):
        opts = dict(VARIANTS.get(name, {}))
        attn = FlexAttention(layout, ["full_attention"], None, 128**-0.5)
        from torch.nn.attention.flex_attention import flex_attention

        mode = "max-autotune-no-cudagraphs" if name == "autotune" else None
        kernel = torch.compile(flex_attention, dynamic=not name.endswith("static"), mode=mode)
        mask = attn.block_masks["full_attention"]
        torch.manual_seed(0)  # the same inputs for every variant
        q = torch.randn(1, 32, q_rows, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, kv_rows, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 8, kv_rows, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, 32, q_rows, 128, device=device, dtype=torch.bfloat16)
        try:
            t0 = time.perf_counter()

            def step():
                with flex_compile_shapes(opts):  # FLASH: no duck shaping (see model/attention.py)
                    out = kernel(q, k, v, block_mask=mask, scale=128**-0.5, enable_gqa=True,
                                 kernel_options=opts or None)
                out.backward(grad)

            step()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            for t in (q, k, v):
                t.grad = None
            with torch.no_grad(), flex_compile_shapes(opts):
                out = kernel(q, k, v, block_mask=mask, scale=128**-0.5, enable_gqa=True, kernel_options=opts or None)
            out.requires_grad_(False)
            step()
            mine = [out.float()] + [t.grad.float() for t in (q, k, v)]
            if reference is None:
                reference, errors = mine, [0.0] * 4
            else:
                errors = [((a - b).norm() / b.norm()).item() for a, b in zip(mine, reference)]
            times = []
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            fwd = []
            with torch.no_grad(), flex_compile_shapes(opts):
                for _ in range(args.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    kernel(q, k, v, block_mask=mask, scale=128**-0.5, enable_gqa=True, kernel_options=opts or None)
                    end.record()
                    torch.cuda.synchronize()
                    fwd.append(start.elapsed_time(end) / 1e3)
            med, fmed = statistics.median(times), statistics.median(fwd)
            res = {"variant": name, "ms_fwd_bwd": 1e3 * med, "ms_fwd": 1e3 * fmed, "tflops_fwd_bwd": flops / med / 1e12,
                   "tflops_fwd": flops / 3 / fmed / 1e12, "compile_s": compile_s,
                   "rel_err_out_dq_dk_dv": [round(e, 5) for e in errors]}
        except Exception as exc:  # noqa: BLE001 - an option the kernel rejects is a result too
            res = {"variant": name, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        results.append(res)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
        sys.stdout.flush()
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
