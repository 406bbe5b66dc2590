"""``draftline plan``: recommend a topology (targets : drafters) and say why.

Without ``--measure`` the rates come from the FLOP model (no GPU needed); with it, the target's
feature pass and the drafter's training step are timed on this device on batches like the data's.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from draftline.config import OptimConfig
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.target import load_target_config
from draftline.monitor.flops import DrafterShape, TargetShape, format_flops, resolve_peak
from draftline.pipeline.plan import colocated_rate, estimate_rates, measure_rates, per_sample_flops, splits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the target model directory")
    parser.add_argument("--data", help="a prepared dataset (its lengths); default: log-normal around --mean-length")
    parser.add_argument("--mean-length", type=int, default=2826, help="mean sample length without --data")
    parser.add_argument("--gpus", type=int, help="GPUs to split (default: this node's count, else 8)")
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--max-query-rows", type=int, default=32768)
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
    from draftline.model.target import TargetFeatures, load_embedding_and_head  # noqa: F401
    from draftline.model.drafter import DFlashDrafter
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


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    target_config = load_target_config(args.target)
    drafter_cfg = build_drafter_config(target_config, num_hidden_layers=args.draft_layers, block_size=args.block_size)
    target_shape, drafter_shape = TargetShape.from_config(target_config), DrafterShape.from_config(drafter_cfg)
    lengths = _lengths(args)
    num_gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 8)
    if num_gpus < 2:
        raise DraftlineError("with one GPU, target and drafter share it (colocated): nothing to split; pass --gpus N >= 2")
    t_flops, d_flops = per_sample_flops(target_shape, drafter_shape, lengths, args.max_anchors)
    print(f"per sample (mean length {lengths.mean():.0f}, {args.max_anchors} anchors, block {args.block_size}): "
          f"target {format_flops(t_flops)}, drafter {format_flops(d_flops)} "
          f"-> the target side is {t_flops / (t_flops + d_flops):.0%} of the work")
    if args.measure:
        rates = _measured(args, drafter_cfg, lengths, device)
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        peak = resolve_peak(device, dtype) if device.type == "cuda" else resolve_peak("cpu", override_flops=788e12)
        rates = estimate_rates(target_shape, drafter_shape, lengths, args.max_anchors, peak.flops)
    print(f"rates per GPU ({rates.source}): target {rates.target_samples_s:.2f} samples/s, "
          f"drafter {rates.drafter_samples_s:.2f} samples/s")
    if rates.target_peak_gib is not None:
        print(f"peak memory at --token-budget {args.token_budget}: target {rates.target_peak_gib:.1f} GiB, "
              f"drafter {rates.drafter_peak_gib:.1f} GiB (train's preflight checks the worst case)")
    table = splits(num_gpus, rates)
    mean_len = float(lengths.mean())
    print(f"\nsplits of {num_gpus} GPUs (best first):")
    print(f"  {'targets':>7} {'drafters':>8} {'samples/s':>10} {'Ktok/s':>8}  who waits")
    for s in table:
        wait = "balanced" if s.waiting_side == "none" else f"{s.waiting_side} idle {s.waiting_share:.0%}"
        print(f"  {s.targets:>7} {s.drafters:>8} {s.samples_s:>10.2f} {s.samples_s * mean_len / 1e3:>8.1f}  {wait}")
    best = table[0]
    both = colocated_rate(num_gpus, rates)
    print(f"  colocated on every GPU (--colocated): {both:.2f} samples/s, {both * mean_len / 1e3:.1f} Ktok/s")
    fits = _colocated_fits(rates, device)
    if fits is False:
        print("  (target and drafter together exceed one GPU's memory at this budget: colocated is out)")
    if fits is not False and both > best.samples_s * 1.02:
        print(f"\nrecommended: --colocated --token-budget {args.token_budget} (draftline train --gpus {num_gpus} ...): "
              f"no split balances the two sides here, and every GPU doing both jobs keeps them all busy")
    else:
        print(f"\nrecommended: --targets {best.targets} --drafters {best.drafters} --token-budget {args.token_budget}"
              f" (draftline train --gpus {num_gpus} ...)")
    return 0


def _colocated_fits(rates, device: torch.device) -> bool | None:
    """Whether the measured target and drafter peaks fit one device together; None if unknown."""
    if rates.target_peak_gib is None or rates.drafter_peak_gib is None or device.type != "cuda":
        return None
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
    return rates.target_peak_gib + rates.drafter_peak_gib <= capacity * 0.95
