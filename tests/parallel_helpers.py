"""CPU ranks (gloo) spawned by a test: target groups inside a larger job compute features on each of their ranks."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _held(layers: torch.nn.Module) -> float:
    """The fraction of the decoder layers' weights this rank holds."""
    local = full = 0
    for param in layers.parameters():
        full += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / full


def _group_features(rank: int, world: int, store: str, groups: list[list[int]], cases: dict, batch, out: str) -> None:
    from draftline.model.target import TargetFeatures

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        made = [dist.new_group(ranks) for ranks in groups]  # every rank of the job creates every group, in order
        mine = [group for ranks, group in zip(groups, made) if rank in ranks]
        for group in mine:
            for name, (target_dir, layer_ids, options) in cases.items():
                target = TargetFeatures(target_dir, layer_ids, dtype=torch.float32, group=group, **options)
                torch.save({"features": target(batch), "held": _held(target.decoder.layers)},
                           Path(out) / f"{name}.{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def group_features(tmp_path: Path, world: int, groups: list[list[int]], cases: dict, batch) -> dict[str, dict]:
    """Spawns ``world`` CPU ranks; the ranks of each of ``groups`` split each case's target among them and compute
    the features of ``batch`` (cases: name -> (target_dir, layer_ids, TargetFeatures options)); a rank in no group
    only takes part in creating the groups, as a drafter would. Returns name -> {rank: {"features": the features,
    "held": the fraction of the decoder layers' weights the rank holds}}."""
    out = tmp_path / "features"
    out.mkdir()
    mp.start_processes(_group_features, args=(world, str(tmp_path / "store"), groups, cases, batch, str(out)),
                       nprocs=world, join=True, start_method="spawn")
    ranks = [rank for group in groups for rank in group]
    return {name: {rank: torch.load(out / f"{name}.{rank}.pt") for rank in ranks} for name in cases}
