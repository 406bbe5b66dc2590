"""``draftline plan``: recommend a topology (targets : drafters) and a token budget, and say why.

Without ``--measure`` the rates come from the FLOP model (no GPU needed) at assumed MFUs of the
GPU's spec peak, and memory from a model of each role (weights, optimizer, activations, queued
features); the GPU need not be this machine's: ``--gpu "RTX PRO 6000"`` takes its spec from the
table, ``--gpu-memory-gib`` / ``--gpu-peak-tflops`` give them directly. With ``--measure`` the
target's feature pass and the drafter's training step are timed on this device on batches like
the data's.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter

import numpy as np
import torch

from draftline.config import OptimConfig
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config, text_config
from draftline.model.target import load_target_config
from draftline.monitor.flops import DrafterShape, TargetShape, format_flops, gpu_spec, resolve_peak
from draftline.monitor.peak import known_gpus
from draftline.pipeline.plan import (
    DRAFTER_MFU,
    TARGET_MFU,
    colocated_rate,
    drafter_memory,
    estimate_rates,
    largest_budget,
    measure_rates,
    per_sample_flops,
    splits,
    target_memory,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the target model directory (only its config.json is read)")
    parser.add_argument("--data", help="a prepared dataset (its lengths); default: log-normal around --mean-length")
    parser.add_argument("--mean-length", type=int, default=2826, help="without --data: the mean sample length in tokens of the assumed length mix (default 2826)")
    parser.add_argument("--gpus", type=int, help="GPUs to split (default: this node's count, else 8)")
    parser.add_argument("--gpu", help='plan for this GPU (its spec: peak and memory), e.g. "H200", "RTX PRO 6000"')
    parser.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU (default: --gpu's, else this one's)")
    parser.add_argument("--gpu-peak-tflops", type=float,
                        help="dense bf16 peak of one GPU in TFLOP/s (default: --gpu's spec, else this one's)")
    parser.add_argument("--target-mfu", type=float, default=TARGET_MFU, help="assumed MFU (0..1 of the spec peak) of the target's pass, without --measure; 0.40 is what it reaches on an H200")
    parser.add_argument("--drafter-mfu", type=float, default=DRAFTER_MFU, help="assumed MFU (0..1 of the spec peak) of the drafter's step, without --measure; 0.32 is what it reaches on an H200")
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--max-query-rows", type=int, default=32768)
    parser.add_argument("--q-hs", type=int, default=8, help="hidden-state queue depth (feature batches in flight)")
    parser.add_argument("--memory-headroom-gib", type=float, default=2.0)
    parser.add_argument("--measure", action="store_true", help="time the roles on this device instead of the FLOP model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def _lengths(args) -> np.ndarray:
    if args.data:
        from draftline.data.dataset import TokenDataset

        lengths = TokenDataset(args.data).lengths
        rng = np.random.default_rng(0)
        return rng.choice(lengths, size=min(len(lengths), 512), replace=False)
    sigma = 0.6
    rng = np.random.default_rng(0)
    mu = math.log(args.mean_length) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, 512), 64, 8192).astype(int)


def _measured(args, drafter_cfg, lengths, device):
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import TargetFeatures
    from draftline.objective.loss import DFlashObjective, ObjectiveSettings
    from draftline.pipeline.drafter_worker import DrafterWorker, GradSync
    from draftline.pipeline.health import Health, local_rank_info
    from draftline.pipeline.optim import build_optimizer, build_scheduler

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = TargetFeatures(args.target, drafter_cfg.dflash_config["target_layer_ids"], device=device, dtype=dtype)
    drafter = DFlashDrafter(drafter_cfg).to(device=device, dtype=torch.float32)
    objective = DFlashObjective(drafter, target.embed_weight(), target.head_weight(),
                                ObjectiveSettings(max_anchors=args.max_anchors))
    optim = OptimConfig()
    optimizer = build_optimizer(drafter, optim)
    health = Health(local_rank_info(0, "plan", device))
    worker = DrafterWorker(
        objective=objective, optimizer=optimizer, scheduler=build_scheduler(optimizer, optim, 10**6), receiver=None,
        sync=GradSync(list(drafter.parameters()), None, health), health=health, device=device, compute_dtype=dtype,
        batches_per_step=1, start_step=0, total_steps=10**9, max_query_rows=args.max_query_rows, grad_clip=1.0,
        max_bad_steps=10**9)
    return measure_rates(target, worker, lengths, args.token_budget, device)


def _hardware(args, device: torch.device) -> tuple[str, float, float]:
    """(what the plan is for, peak FLOP/s of one GPU, memory GiB of one GPU)."""
    given = args.gpu_memory_gib is not None and args.gpu_peak_tflops is not None
    if args.gpu:
        spec = gpu_spec(args.gpu)
        if spec is None and not given:
            names = ", ".join(f'"{g.name}"' for g in known_gpus())
            raise DraftlineError(f"--gpu {args.gpu!r} is not in the spec table ({names}); "
                                 "give its numbers with --gpu-memory-gib and --gpu-peak-tflops")
    elif device.type == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(device))
    else:
        spec = None if given else gpu_spec("H200")  # a CPU machine: plan for the reference GPU (printed)
    name = spec.name if spec is not None else (args.gpu or ("the given GPU" if given else str(device)))
    if args.gpu_peak_tflops is not None:
        peak = args.gpu_peak_tflops * 1e12
    else:
        peak = spec.bf16_flops if spec is not None else resolve_peak(device).flops
    if args.gpu_memory_gib is not None:
        memory = args.gpu_memory_gib
    else:
        memory = spec.memory_gib if spec is not None else torch.cuda.get_device_properties(device).total_memory / 2**30
    if peak <= 0 or memory <= 0:
        raise DraftlineError("--gpu-peak-tflops and --gpu-memory-gib must be positive")
    return name, peak, memory


def _describe_layers(target_config, layers_run: int) -> str:
    text = text_config(target_config)
    kinds = [layer.kind for layer in TargetShape.from_config(target_config).layers]
    counts = Counter(kinds[:layers_run])
    mix = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items())
    moe = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    experts = f"; MoE: {text.num_experts_per_tok} of {moe} experts per token" if moe else ""
    return f"target: {len(kinds)} layers, the feature pass runs {layers_run} ({mix}){experts}"


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    target_config = load_target_config(args.target)
    drafter_cfg = build_drafter_config(target_config, num_hidden_layers=args.draft_layers, block_size=args.block_size)
    target_shape, drafter_shape = TargetShape.from_config(target_config), DrafterShape.from_config(drafter_cfg)
    layers_run = drafter_shape.target_layers_run
    lengths = _lengths(args)
    num_gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 8)
    if num_gpus < 2:
        raise DraftlineError("with one GPU, target and drafter share it (colocated): nothing to split; pass --gpus N >= 2")
    gpu_name, peak, memory = _hardware(args, device)
    print(f"planning for {num_gpus} x {gpu_name}: {format_flops(peak)}/s dense bf16, {memory:.0f} GiB each")
    print(_describe_layers(target_config, layers_run))
    t_flops, d_flops = per_sample_flops(target_shape, drafter_shape, lengths, args.max_anchors)
    print(f"per sample (mean length {lengths.mean():.0f}, {args.max_anchors} anchors, block {args.block_size}): "
          f"target {format_flops(t_flops)}, drafter {format_flops(d_flops)} "
          f"-> the target side is {t_flops / (t_flops + d_flops):.0%} of the work")
    if args.measure:
        rates = _measured(args, drafter_cfg, lengths, device)
    else:
        rates = estimate_rates(target_shape, drafter_shape, lengths, args.max_anchors, peak,
                               args.target_mfu, args.drafter_mfu)
    print(f"rates per GPU ({rates.source}): target {rates.target_samples_s:.2f} samples/s, "
          f"drafter {rates.drafter_samples_s:.2f} samples/s")
    if rates.target_peak_gib is not None:
        print(f"peak memory measured at --token-budget {args.token_budget}: target {rates.target_peak_gib:.1f} GiB, "
              f"drafter {rates.drafter_peak_gib:.1f} GiB (train's preflight checks the worst case)")
    table = splits(num_gpus, rates)
    best = table[0]
    split, colocated = _memory_plan(args, target_shape, drafter_shape, layers_run, memory, best.targets)
    mean_len = float(lengths.mean())
    print(f"\nsplits of {num_gpus} GPUs (best first):")
    print(f"  {'targets':>7} {'drafters':>8} {'samples/s':>10} {'Ktok/s':>8}  who waits")
    for s in table:
        wait = "balanced" if s.waiting_side == "none" else f"{s.waiting_side} idle {s.waiting_share:.0%}"
        print(f"  {s.targets:>7} {s.drafters:>8} {s.samples_s:>10.2f} {s.samples_s * mean_len / 1e3:>8.1f}  {wait}")
    both = colocated_rate(num_gpus, rates)
    print(f"  colocated on every GPU (--colocated): {both:.2f} samples/s, {both * mean_len / 1e3:.1f} Ktok/s"
          + ("" if colocated else " (does not fit one GPU: out)"))
    # Colocated wins on throughput when no split balances, unless memory forces it to a smaller budget.
    if colocated and (split is None or (both > best.samples_s * 1.02 and colocated[0] >= split[0])):
        print(f"\nrecommended: --colocated {_budget_flags(args, *colocated)} (draftline train --gpus {num_gpus} ...): "
              f"no split balances the two sides here, and every GPU doing both jobs keeps them all busy")
    elif split:
        print(f"\nrecommended: --targets {best.targets} --drafters {best.drafters} {_budget_flags(args, *split)}"
              f" (draftline train --gpus {num_gpus} ...)")
    else:
        print(f"\nnothing fits: the target or the drafter alone exceeds one GPU's {memory:.0f} GiB; use GPUs with "
              "more memory or fewer --draft-layers")
    return 0


def _budget_flags(args, budget: int, query_rows: int) -> str:
    flags = f"--token-budget {budget}"
    return flags + (f" --max-query-rows {query_rows}" if query_rows < args.max_query_rows else "")


def _memory_plan(args, target_shape, drafter_shape, layers_run: int, memory_gib: float,
                 num_targets: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """Print each role's memory at --token-budget and what fits one GPU; return (token budget, query
    rows) for the split and for colocated training (None where nothing fits)."""
    limit = memory_gib - args.memory_headroom_gib
    features = len(drafter_shape.target_layer_ids) + (1 if drafter_shape.teacher_layers else 0)
    outbox = -(-args.q_hs // num_targets) + 1
    requested, rows = args.token_budget, args.max_query_rows

    def target_at(budget):
        return target_memory(target_shape, layers_run, budget, features, outbox)

    def drafter_at(budget, query_rows):
        return drafter_memory(drafter_shape, budget, query_rows, 3)

    def colocated_at(budget, query_rows):  # the target's pass beside the drafter, q_hs batches queued
        target = target_memory(target_shape, layers_run, budget, features, args.q_hs)
        return target.total + drafter_memory(drafter_shape, budget, query_rows, 0).total

    def rows_fitting(fits) -> int | None:
        return largest_budget(fits, upper=rows, step=1024)

    print(f"\nmemory per GPU at --token-budget {requested}, --max-query-rows {rows} "
          "(an estimate; train's preflight measures the worst case):")
    print(f"  target  {target_at(requested).describe()}")
    print(f"  drafter {drafter_at(requested, rows).describe()}")
    print(f"  colocated {colocated_at(requested, rows):.1f} GiB")

    split = None
    fit_target = largest_budget(lambda b: target_at(b).total <= limit)
    if fit_target:
        budget = min(requested, fit_target)
        query_rows = rows_fitting(lambda r: drafter_at(budget, r).total <= limit)
        split = (budget, query_rows) if query_rows else None
    colocated = None
    for budget in range(requested - requested % 4096 or 4096, 0, -4096):
        query_rows = rows_fitting(lambda r: colocated_at(budget, r) <= limit)
        if query_rows and query_rows >= min(rows, 4096):
            colocated = (budget, query_rows)
            break
    print(f"  within {limit:.0f} GiB: target up to --token-budget {fit_target or 'none'}; "
          + (f"drafter at --token-budget {split[0]} up to --max-query-rows {split[1]}; " if split else "drafter: nothing; ")
          + (f"colocated at --token-budget {colocated[0]}, --max-query-rows {colocated[1]}" if colocated
             else "colocated: nothing fits"))
    return split, colocated
