"""``draftline plan``: every layout of N GPUs (targets + drafters, or colocated), its speed and memory per
GPU, and the recommended one with its ``draftline train`` command.

Rates: the FLOP model at the MFUs this project measured per role on an H200 (as the same share of
another GPU's spec peak, e.g. ``--gpu "RTX PRO 6000"``; the output says so), or with ``--measure``
the roles timed on the GPU in hand. Memory: a model of each role (weights, optimizer state sharded
over the drafters, activations, queued features); ``train``'s preflight measures the real worst case.
Only the target's ``config.json`` is read: a 27B target can be planned on a laptop.

A target that fits no layout with a whole copy per GPU is planned split over target groups
(``--target-parallel K``, ``sizing/target_groups.py``): every group size the target's heads or experts divide,
each with one rank's memory, the all-reduce traffic over the link (NVLink or PCIe, named from the GPU table's
bandwidth) and the time it adds; ``--target-parallel K`` plans that size alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from draftline.config import TrainConfig, check_method
from draftline.config_flags import add_field_argument
from draftline.errors import DraftlineError
from draftline.model.config import text_config
from draftline.model.target_parallel import check_group_size, group_sizes
from draftline.pipeline.spec import ModelSpec
from draftline.sizing.memory_estimate import MemoryInputs
from draftline.sizing.peak import format_flops, gpu_spec, known_gpus
from draftline.sizing.plan import (
    ANCHOR_SWEEP, MEASURED_MFU, estimate_rates, group_rates, hardware_for, measure_rates, passes_per_sample,
    per_sample_flops, plan_layouts, target_mfu, with_anchors,
)
from draftline.sizing.target_groups import group_traffic, link_kind, rank_shape
from draftline.sizing.workload import MEAN_LENGTH, reference_lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to train")
    what_field = functools.partial(add_field_argument, what)
    what_field("model", "target", required=True, own_help="the target model directory (only its config.json is read)")
    what.add_argument("--data", help="a prepared dataset: its sample lengths (default: log-normal around --mean-length)")
    what.add_argument("--mean-length", type=int, default=MEAN_LENGTH, help="mean sample length in tokens without --data")
    what_field("model", "draft_layers", own_help="drafter layers, none = 5 as in train")
    what_field("model", "block_size", own_help="tokens per block, none = 16 as in train")
    what_field("data", "max_anchors",
               own_help="anchors per document: the drafter's work grows with it (the plan also shows 128, 256, 512)")
    what_field("optim", "distill", own_help="soft-label weight (above 0 the target runs every layer)")
    what_field("model", "method", own_help="the drafter trained: dflash or dspark (DSpark's heads, the target's final "
                                           "hidden state and its loss in the FLOPs and memory)")
    what_field("model", "markov_rank", own_help="DSpark's Markov head rank, none = 256 (with --method dspark)")
    what_field("model", "target_fp8", own_help="the target's linear layers in FP8, as train's --target-fp8: their weights "
                                               "at one byte, the pass at the MFU measured in FP8 where it was")
    node = parser.add_argument_group("the node")
    node.add_argument("--gpus", type=int, help="GPUs of the node (default: this node's count, else 8)")
    node.add_argument("--gpu", help='plan for this GPU by name, from the spec table (e.g. "H200", "RTX PRO 6000"); '
                                    "default: this machine's GPU, else an H200")
    node.add_argument("--gpu-memory-gib", type=float,
                      help="memory of one GPU in GiB as torch reports it (its whole capacity, CUDA's context included; "
                           "train's --gpu-memory-gib simulates such a card), for a GPU not in the spec table "
                           "(default: --gpu's)")
    node.add_argument("--gpu-peak-tflops", type=float, help="dense bf16 peak of one GPU in TFLOP/s (default: --gpu's)")
    node.add_argument("--link-gbs", type=float,
                      help="collective bandwidth between the GPUs in GB/s, what sharded drafters move their state over "
                           "(default: assumed from the GPU: NVLink or PCIe 5)")
    node.add_argument("--target-parallel", type=int, metavar="RANKS",
                      help="plan targets split over groups of this many ranks (train's [topology] target_parallel); "
                           "default: a whole target per GPU, or, where no such layout fits, every group size the "
                           "target's heads or experts divide")
    node.add_argument("--measure", action="store_true",
                      help="time the target's pass and the drafter's step on this machine's GPU instead of the measured MFUs")
    node.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the device --measure times the roles on (cuda or cpu)")
    sizes = parser.add_argument_group("sizes (as train's flags)")
    add_field_argument(sizes, "data", "token_budget", own_help="tokens per batch asked for (the plan may lower it to fit)")
    add_field_argument(sizes, "engine", "max_query_rows", own_help="block rows per drafter pass asked for")
    add_field_argument(sizes, "topology", "q_hs",
                       own_help="feature batches the hidden-state queue holds; none: 2 in a colocated layout, 8 in a split")
    add_field_argument(sizes, "engine", "memory_headroom_gib", own_help="GiB per GPU kept free, as preflight")
    add_field_argument(sizes, "engine", "head_chunk_rows", own_help="rows of logits the LM head makes at once, as train")
    add_field_argument(sizes, "engine", "recompute", own_help="what the drafter's layers recompute in backward, as train")
    add_field_argument(sizes, "optim", "moments", own_help="AdamW's moments in fp32 or bf16, as train")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="also write every layout and the recommendation to this JSON file")


def _lengths(args) -> np.ndarray:
    if args.data:
        from draftline.data.dataset import TokenDataset

        lengths = TokenDataset(args.data).lengths
        rng = np.random.default_rng(0)
        return rng.choice(lengths, size=min(len(lengths), 512), replace=False)
    return reference_lengths(args.mean_length)


def _model(args) -> ModelSpec:
    config = TrainConfig()
    config.model.target = args.target
    config.model.draft_layers, config.model.block_size = args.draft_layers, args.block_size
    config.model.init_from_target = False  # the shape is all a plan needs
    config.optim.distill = args.distill
    config.model.method, config.model.markov_rank = args.method, args.markov_rank
    check_method(config)  # DSpark options only with DSpark
    return ModelSpec.resolve(config)


def _measured(args, model: ModelSpec, lengths, device):
    from draftline.distributed.health import Health, local_rank_info
    from draftline.model.target import TargetFeatures
    from draftline.pipeline.build import build_drafter_worker
    from draftline.pipeline.spec import RunSpec
    from draftline.pipeline.transport import Delivery

    config = TrainConfig()
    config.data.max_anchors = args.max_anchors
    config.engine.max_query_rows = args.max_query_rows
    spec = RunSpec.standalone(config, model, device)
    target = TargetFeatures(args.target, list(model.layer_ids), device=device, dtype=spec.dtype,
                            config=model.target_file_config, fp8=bool(args.target_fp8))
    worker = build_drafter_worker(spec, Health(local_rank_info(0, "plan", device)), target=target)

    def drafter_step(batch, features):
        worker.train_step(Delivery(batch.index, features, batch))

    rates = measure_rates(target, drafter_step, lengths, args.token_budget, device)
    worker.read_record()  # the last step's, read one step late as in training
    return rates


def _describe_layers(model: ModelSpec) -> str:
    text = text_config(model.target_config)
    kinds = [layer.kind for layer in model.target_shape.layers]
    counts = Counter(kinds[: model.layers_run])
    mix = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items())
    moe = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    experts = f"; MoE: {text.num_experts_per_tok} of {moe} experts per token" if moe else ""
    d = model.drafter_config
    return (f"target: {len(kinds)} layers, the feature pass runs {model.layers_run} ({mix}){experts}\n"
            f"drafter: {d.num_hidden_layers} layers, {d.num_attention_heads} heads x {d.head_dim} "
            f"({d.num_key_value_heads} KV), block {model.block_size}, {model.num_trained_params / 1e9:.2f}B trained "
            f"weights ({16 * model.num_trained_params / 2**30:.1f} GiB of state unsharded)")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    model = _model(args)
    lengths = _lengths(args)
    num_gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 8)
    if num_gpus < 1:
        raise DraftlineError("--gpus must be at least 1")
    if args.gpu and args.gpu_memory_gib is None and args.gpu_peak_tflops is None:
        if gpu_spec(args.gpu) is None:
            names = ", ".join(f'"{g.name}"' for g in known_gpus())
            raise DraftlineError(f"--gpu {args.gpu!r} is not in the spec table ({names}); "
                                 "give its numbers with --gpu-memory-gib and --gpu-peak-tflops")
    hardware = hardware_for(device, args.gpu, memory_gib=args.gpu_memory_gib, peak_tflops=args.gpu_peak_tflops,
                            link_gbs=args.link_gbs)
    if not hardware.peak_flops > 0 or not hardware.memory_gib > 0:
        raise DraftlineError("give the GPU's numbers: --gpu NAME, or --gpu-memory-gib and --gpu-peak-tflops")
    if args.target_parallel is not None:
        if not 1 <= args.target_parallel <= num_gpus:
            raise DraftlineError(f"--target-parallel {args.target_parallel}: a target group needs 1 to the node's "
                                 f"{num_gpus} GPUs (--gpus)")
        check_group_size(model.target_file_config, args.target_parallel, where="--target-parallel")
        if args.measure and args.target_parallel > 1:
            raise DraftlineError("--measure times a whole target on this machine's one GPU; plan --target-parallel "
                                 f"{args.target_parallel} from the FLOP model (drop --measure)")
    spec = gpu_spec(args.gpu or hardware.name) if args.gpu_memory_gib is None else None
    memory_source = spec.memory_source if spec is not None else "given"
    print(f"planning for {num_gpus} x {hardware.name}: {format_flops(hardware.peak_flops)}/s dense bf16, "
          f"{hardware.memory_gib:.2f} GiB each ({memory_source}), {hardware.link_gbs:.0f} GB/s between GPUs "
          f"({link_kind(hardware.link_gbs)}; {hardware.link_source})")
    print(_describe_layers(model))
    mean_length = float(lengths.mean())
    t_flops, d_flops = per_sample_flops(model.target_shape, model.drafter_shape, lengths, args.max_anchors)
    print(f"per sample (mean length {mean_length:.0f}, {args.max_anchors} anchors, block {model.block_size}): "
          f"target {format_flops(t_flops)}, drafter {format_flops(d_flops)}")
    if args.measure:
        rates = _measured(args, model, lengths, device)
    else:
        rates = estimate_rates(model.target_shape, model.drafter_shape, lengths, args.max_anchors, hardware.peak_flops,
                               target_fp8=bool(args.target_fp8))
        print(f"  MFUs measured: target {target_mfu(model.target_shape, bool(args.target_fp8))[1]}; drafter "
              f"{MEASURED_MFU['drafter'][1]}; taken as the same share of this GPU's spec peak")
    print(f"rates per GPU ({rates.source}): target {rates.target_samples_s:.2f} samples/s, "
          f"drafter {rates.drafter_samples_s:.2f} samples/s")
    inputs = MemoryInputs(model.target_shape, model.drafter_shape, model.layers_run,
                          len(model.layer_ids) + int(model.final_hidden), args.q_hs, recompute=args.recompute,
                          moments=args.moments, head_chunk_rows=args.head_chunk_rows, target_fp8=bool(args.target_fp8))
    min_budget = int(lengths.max()) if args.data else 4096

    groups = _Groups(model, lengths, mean_length, hardware, t_flops)

    def layouts_at(r, anchors=args.max_anchors, sizes=(1,)):
        out = []
        for k in sizes:
            rates_k, traffic, link_share = groups.rates(r, k)
            out += plan_layouts(num_gpus, rates_k, hardware, groups.inputs(inputs, k), token_budget=args.token_budget,
                                max_query_rows=args.max_query_rows, mean_length=mean_length,
                                passes_per_sample=lambda rows: passes_per_sample(lengths, anchors, model.block_size,
                                                                                 rows),
                                headroom_gib=args.memory_headroom_gib, min_budget=min_budget, target_parallel=k,
                                traffic=traffic, link_share=link_share)
        return sorted(out, key=lambda layout: (not layout.fits, -layout.samples_s))

    if args.target_fp8 and (args.target_parallel or 1) > 1:
        raise DraftlineError(f"--target-fp8 converts a whole target; a target split over ranks (--target-parallel "
                             f"{args.target_parallel}) keeps its dtype: drop one of the two")
    sizes = ((args.target_parallel,) if args.target_parallel else (1,) if args.target_fp8
             else tuple(group_sizes(model.target_file_config, num_gpus)))
    layouts = layouts_at(rates, sizes=sizes)
    if max(sizes) > 1:
        print(f"target groups (--target-parallel) of {', '.join(str(k) for k in sizes if k > 1)} ranks, the target split "
              "by transformers' plans:")
        for k in sizes:
            if k > 1:
                print("  " + groups.describe(k))
    if 1 in sizes and not any(layout.fits for layout in layouts if layout.target_parallel == 1):
        print("no layout fits with a whole target per GPU: a target group splits it")
    print(f"\nlayouts of {num_gpus} GPUs, best first (memory per GPU: allocated at the worst case and outside the "
          f"allocator, at the largest budget that fits {hardware.memory_gib - args.memory_headroom_gib:.2f} GiB, up to "
          f"--token-budget {args.token_budget}):")
    print(f"  {'layout':<34} {'Ktok/s':>7}  {'budget':>7} {'rows':>6}  {'target GiB':>10} {'drafter GiB':>11}  who waits")
    shown = [layout for layout in layouts if layout.target_parallel == 1 or layout.fits]
    hidden = len(layouts) - len(shown)
    for layout in shown:
        target = f"{layout.memory_target.total:.1f}" if layout.memory_target else "-"
        drafter = "(same GPU)" if layout.colocated else f"{layout.memory_drafter.total:.1f}"
        print(f"  {layout.name():<34} {layout.ktok_s:>7.1f}  {layout.token_budget:>7} {layout.max_query_rows:>6}  "
              f"{target:>10} {drafter:>11}  {layout.waiting}{'' if layout.fits else '; does not fit'}")
    if hidden:
        print(f"  ({hidden} layout{'s' if hidden > 1 else ''} with target groups that do not fit left out here; "
              "--json lists every layout)")
    best = layouts[0]
    record = {"hardware": {"name": hardware.name, "peak_tflops": hardware.peak_flops / 1e12,
                           "memory_gib": hardware.memory_gib, "link_gbs": hardware.link_gbs,
                           "link": link_kind(hardware.link_gbs), "link_source": hardware.link_source},
              "source": rates.source, "layouts": [layout.to_record() for layout in layouts]}
    if not best.fits:
        split = f" (even split over target groups of up to {max(sizes)} ranks)" if max(sizes) > 1 else ""
        print(f"\nnothing fits: the target or the drafter alone exceeds one GPU's {hardware.memory_gib:.0f} GiB{split}; "
              "use more GPUs for the drafters (their state is sharded), GPUs with more memory, or fewer --draft-layers")
        record["recommended"] = None
    else:
        launch = ["--gpus", str(num_gpus)] if num_gpus > 1 else []
        flags = best.flags(args.max_query_rows)
        if num_gpus == 1:
            flags.remove("--colocated")  # one process is colocated anyway
        command = ["draftline", "train", *launch, *flags, *(["--target-fp8"] if args.target_fp8 else []),
                   "--max-anchors", str(args.max_anchors), "--target", str(args.target), "--data", "DATA", "--out", "RUN"]
        print(f"\nrecommended: {best.name()} at {best.ktok_s:.1f} Ktok/s ({best.samples_s:.2f} samples/s):\n  "
              + " ".join(command))
        _describe_memory(best, hardware)
        record["recommended"] = {**best.to_record(), "command": " ".join(command),
                                 "memory_components_gib": _components(best)}
        record["anchors"] = _anchor_sweep(args, model, rates, lengths,
                                          lambda r, a: layouts_at(r, a, sizes=(best.target_parallel,)), best)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _describe_memory(layout, hardware) -> None:
    k = layout.target_parallel
    share = f"1/{k} of the target" if k > 1 else "its target"
    memories = [("per GPU", layout.memory_target, f" ({share} and its 1/{layout.drafters} of the drafter's state)")]
    if not layout.colocated:
        sender = f" ({share}, the outbox on the group's sending rank)" if k > 1 else ""
        memories = [("per target GPU", layout.memory_target, sender),
                    ("per drafter GPU", layout.memory_drafter, f" (state sharded over {layout.drafters})")]
    for who, memory, note in memories:
        print(f"  memory {who}: {memory.describe()}{note}")
        for name, kind, value in memory.table():
            print(f"    {value:7.2f} GiB  {kind:<11} {name}")
    if k > 1:
        traffic = layout.to_record()["link_traffic"]
        print(f"  target groups of {k}: {traffic['gb_s_per_gpu']:.1f} GB/s per GPU over {link_kind(hardware.link_gbs)} "
              f"at this rate, {traffic['share_of_target_time']:.0%} of a group's time on the link "
              f"(assumed {hardware.link_gbs:.0f} GB/s, not overlapped with compute)")


def _components(layout) -> dict:
    """The recommended layout's memory per GPU by component (GiB), per role."""
    roles = {"gpu": layout.memory_target} if layout.colocated else {"target": layout.memory_target,
                                                                    "drafter": layout.memory_drafter}
    return {role: {"allocated": round(m.allocated, 2), "total": round(m.total, 2), "device_uncapped": round(m.device, 2),
                   "parts": {name: round(value, 3) for name, _, value in m.table()}} for role, m in roles.items()}


class _Groups:
    """The plan's target groups: one rank's share of the target, its rates and its link traffic, per group size."""

    def __init__(self, model: ModelSpec, lengths, mean_length: float, hardware, flops_whole: float):
        self.model, self.lengths, self.mean_length, self.hardware = model, lengths, mean_length, hardware
        self.flops_whole = flops_whole

    def shape(self, k: int):
        return rank_shape(self.model.target_shape, self.model.target_file_config, k)

    def traffic(self, k: int):
        return group_traffic(self.model.target_shape, self.model.target_file_config, self.model.layers_run, k)

    def inputs(self, inputs: MemoryInputs, k: int) -> MemoryInputs:
        return inputs if k == 1 else dataclasses.replace(inputs, target_shape=self.shape(k))

    def rates(self, rates, k: int):
        """(per-GPU rates for groups of ``k``, the group's traffic, the share of its time on the link)."""
        if k == 1:
            return rates, None, 0.0
        flops_rank, _ = per_sample_flops(self.shape(k), self.model.drafter_shape, self.lengths, 1)
        traffic = self.traffic(k)
        rates_k, link_share = group_rates(rates, k, self.flops_whole, flops_rank, traffic, self.mean_length,
                                          self.hardware.link_gbs)
        return rates_k, traffic, link_share

    def describe(self, k: int) -> str:
        traffic = self.traffic(k)
        weights = self.shape(k).with_layers_run(self.model.layers_run).params() * 2 / 2**30
        per_token = traffic.seconds_per_token(self.hardware.link_gbs) * 1e6
        return (f"groups of {k}: {weights:.1f} GiB of the target's weights per rank; {traffic.describe(self.model.hidden_size)}; "
                f"{per_token:.1f} us per token at {self.hardware.link_gbs:.0f} GB/s ({link_kind(self.hardware.link_gbs)})")


def _anchor_sweep(args, model, rates, lengths, layouts_at, best) -> list[dict]:
    """The recommended layout at 128, 256 and 512 anchors per document: the drafter's share of the work moves."""
    print(f"\nthe recommended layout ({best.name()}) at other anchors per document:")
    print(f"  {'anchors':>7} {'Ktok/s':>7}  memory GiB per GPU")
    rows = []
    for anchors in sorted(set(ANCHOR_SWEEP) | {args.max_anchors}):
        at = with_anchors(rates, model.target_shape, model.drafter_shape, lengths, args.max_anchors, anchors)
        same = next(l for l in layouts_at(at, anchors) if (l.targets, l.drafters, l.colocated) ==
                    (best.targets, best.drafters, best.colocated))
        memory = same.to_record()["memory_gib"]
        print(f"  {anchors:>7} {same.ktok_s:>7.1f}  target {memory['target']}, drafter {memory['drafter']}")
        rows.append({"max_anchors": anchors, "ktok_s": round(same.ktok_s, 3), "memory_gib": memory, "fits": same.fits})
    return rows
