"""The planner's memory model against what one GPU measures, component by component (GPU only).

    python bench/memory_model.py --shape 27b-hybrid --gpu-memory-gib 96 --budget 16384 --rows 4096

Builds the shape's target (random bf16 weights, the layers the feature pass runs) and the default drafter
colocated beside it, as ``draftline train`` does on one GPU, under a memory cap
(``torch.cuda.set_per_process_memory_fraction``: the seeds' 96 GB GPU on a larger one), and measures:

- target: bytes allocated once the target is built (its weights, embedding and head);
- drafter state: bytes allocated after one training step minus before the drafter was built (fp32 master
  weights and AdamW's two moments; the gradients are freed after the step);
- target activations: the peak of a feature pass over ``--budget`` tokens above what was resident;
- drafter step: the peak of a training step (``--budget`` tokens, passes of ``--rows`` block rows) above
  what was resident: activations, the gradients, the features in hand.

Each beside the planner's figure for it (``draftline plan``'s memory model), with the error. One table at the end, and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import HYBRID, lognormal_lengths, make_worker, packed_batch, random_target, train_step  # noqa: E402

from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.model.target import TargetFeatures  # noqa: E402
from draftline.sizing.flops import DrafterShape, TargetShape  # noqa: E402
from draftline.sizing.plan import drafter_memory, target_memory  # noqa: E402
from draftline.pipeline.transport import Delivery  # noqa: E402

GIB = 2**30


def allocated() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GIB


def peak_of(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="27b-hybrid",
                        help="the target's shape, as bench_line.py names them: 8b, 32b, 1.7b, 27b-hybrid (default: %(default)s)")
    parser.add_argument("--gpu-memory-gib", type=float, default=96.0,
                        help="cap this process at this much GPU memory, as train's --gpu-memory-gib (default: %(default)s)")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per batch, train's --token-budget (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=4096,
                        help="block rows per drafter pass, train's --max-query-rows (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total))
    attn = "draftline_flex" if args.shape in HYBRID else "flex_attention"
    if args.shape in HYBRID:
        from draftline.model.linear_attention import register_packed_flex

        register_packed_flex()
    model = random_target(args.shape, device, torch.bfloat16, attn)
    drafter_cfg = build_drafter_config(model.config)
    layer_ids = drafter_cfg.dflash_config["target_layer_ids"]
    target = TargetFeatures.from_model(model, layer_ids)
    del model
    torch.cuda.empty_cache()
    drafter_shape = DrafterShape.of(drafter_cfg)
    rows = []

    def row(component, measured, planned):
        rows.append({"component": component, "measured_gib": measured, "planned_gib": planned,
                     "error": (planned - measured) / measured if measured else float("nan")})
        print(f"{component}: measured {measured:.2f} GiB, planned {planned:.2f} GiB "
              f"({(planned - measured) / measured:+.1%})", flush=True)

    # The planner's target is built from the full config; the feature pass keeps layers_run of them.
    full_shape = TargetShape.of(random_config(args.shape))
    planned_target = target_memory(full_shape, drafter_shape.target_layers_run, args.budget, len(layer_ids), 0)
    row("target weights", allocated(), planned_target.weights)
    rng = np.random.default_rng(0)
    vocab = drafter_cfg.vocab_size
    batch = packed_batch(lognormal_lengths(rng, args.budget), vocab, 0, 0)
    with torch.no_grad():
        target_peak = peak_of(lambda: target(batch))
    row("target activations (one feature pass)", target_peak,
        planned_target.activations + planned_target.buffers / 1)  # the features it returns: one batch

    before = allocated()
    worker = make_worker(drafter_cfg, device, torch.bfloat16, args.rows, target.embed_weight(), target.head_weight(),
                         head_chunk_rows=2048)
    features = target(batch)
    delivery = Delivery(0, features, batch)
    train_step(worker, delivery)
    worker.read_record()
    state = allocated() - before - features.numel() * features.element_size() / GIB
    planned = drafter_memory(drafter_shape, args.budget, args.rows, 0, frozen_weights=False)
    row("drafter state (fp32 weights + AdamW moments)", state, planned.weights + planned.optimizer
        - 4 * planned.optimizer / 8)  # the plan's weights hold the fp32 gradients too (4 of its 8 bytes)

    def step():
        train_step(worker, delivery)
        worker.read_record()

    step_peak = peak_of(step)
    row("drafter step (activations + gradients)", step_peak, planned.activations + 4 * planned.optimizer / 8)
    colocated = planned_target.weights + planned.weights + planned.optimizer + max(
        target_peak, planned.activations)  # what the plan adds up for one GPU, without queued features
    print(f"\nplanned per GPU at --token-budget {args.budget}, --max-query-rows {args.rows} (without queued features): "
          f"{colocated:.1f} GiB; the process's peak here: {torch.cuda.max_memory_allocated() / GIB:.1f} GiB of "
          f"{args.gpu_memory_gib:.0f}")
    print("\n| component | measured GiB | planned GiB | error |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['component']} | {r['measured_gib']:.2f} | {r['planned_gib']:.2f} | {r['error']:+.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "budget": args.budget, "rows": args.rows,
                                         "device": torch.cuda.get_device_name(), "rows_": rows}, indent=2))


def random_config(shape: str):
    from workloads import target_config

    return target_config(shape)


if __name__ == "__main__":
    main()
