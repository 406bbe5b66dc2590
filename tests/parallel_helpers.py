"""CPU ranks (gloo) spawned by a test: target groups inside a larger job compute features on each of their ranks."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "draftline.model.target",
                "draftline.distributed.shard", "draftline.distributed.target_group"]
"""What every test's CPU ranks import, imported once by the fork server they are forked from."""


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """Runs ``fn(rank, *args)`` on ``nprocs`` processes and waits for them. The ranks are forked from a server
    process that imported torch and transformers once (it stays for the session): a spawned rank imported them
    itself, ~4 s of CPU each, and 5 ranks on two cores took ~10 s to start. The server is a fresh process, not
    this one: a fork of a process whose OpenMP threads ran is not safe."""
    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _held(layers: torch.nn.Module, only: str = "") -> float:
    """The fraction of the decoder layers' weights this rank holds (``only``: of the weights whose names hold it)."""
    local = full = 0
    for name, param in layers.named_parameters():
        if only not in name:
            continue
        full += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / full if full else float("nan")


def _group_features(rank: int, world: int, store: str, groups: list[list[int]], cases: dict, batch, out: str,
                    device_type: str) -> None:
    from draftline.model.target import TargetFeatures

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    try:
        made = [dist.new_group(ranks) for ranks in groups]  # every rank of the job creates every group, in order
        options_device = {"device": device} if device.type == "cuda" else {}
        mine = [group for ranks, group in zip(groups, made) if rank in ranks]
        for group in mine:
            for name, (target_dir, layer_ids, options) in cases.items():
                target = TargetFeatures(target_dir, layer_ids, dtype=torch.float32, group=group, **options_device,
                                        **options)
                embed, head = target.embed_weight(), target.head_weight()
                torch.save({"features": target(batch).cpu(), "held": _held(target.decoder.layers),
                            "held_experts": _held(target.decoder.layers, "experts"),
                            # what a colocated drafter's objective is handed: whole tensors, not a rank's shard
                            "embed": embed.cpu(), "head": head.cpu(), "tied": embed is head,
                            "plain": not any(hasattr(t, "to_local") for t in (embed, head))},
                           Path(out) / f"{name}.{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def group_features(tmp_path: Path, world: int, groups: list[list[int]], cases: dict, batch,
                   device_type: str = "cpu") -> dict[str, dict]:
    """Spawns ``world`` CPU ranks (``device_type`` "cuda": one GPU each, NCCL); the ranks of each of ``groups`` split each case's target among them and compute
    the features of ``batch`` (cases: name -> (target_dir, layer_ids, TargetFeatures options)); a rank in no group
    only takes part in creating the groups, as a drafter would. Returns name -> {rank: {"features": the features,
    "held": the fraction of the decoder layers' weights the rank holds, "held_experts": of the experts' weights
    (NaN for a dense target), "embed"/"head": ``embed_weight()``/``head_weight()``, "tied": whether they are one
    tensor, "plain": whether both are plain tensors (no DTensor)}}."""
    out = tmp_path / "features"
    out.mkdir()
    start_ranks(_group_features, (world, str(tmp_path / "store"), groups, cases, batch, str(out), device_type), world)
    ranks = [rank for group in groups for rank in group]
    return {name: {rank: torch.load(out / f"{name}.{rank}.pt") for rank in ranks} for name in cases}
