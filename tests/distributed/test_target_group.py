"""A target group's agreements on CPU ranks (gloo): every rank of a job creates every group, the group's ranks agree on
each batch (ranks at different batches are a bug, raised) and on preflight's peaks (the largest; an out-of-memory on
any rank is everyone's)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from parallel_helpers import start_ranks

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from draftline.distributed.health import Health, RankInfo
    from draftline.distributed.roles import assign_roles
    from draftline.distributed.target_group import make_target_group

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        role = assign_roles(world, 4, 1, target_parallel=2)[rank]  # drafter 0; groups 1-2 and 3-4
        group = make_target_group(role, rank, torch.device("cpu"), Health(RankInfo(rank, role.kind, "here", "CPU",
                                                                                   os.getpid())))
        result = {"group": None if group is None else (group.index, group.ranks, group.rank_in_group)}
        if group is not None:
            group.agree_next(7)
            group.agree_next(None)
            result["peak"] = group.agree_peak(float(rank))
            result["oom"] = group.agree_peak(None if rank in (2, 3) else 1.0)
            try:
                group.agree_next(rank)  # the two ranks of a group at different batches
            except RuntimeError as exc:
                result["disagree"] = str(exc)
        torch.save(result, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_target_groups_agree_on_each_batch_and_on_the_largest_peak(tmp_path):
    start_ranks(_rank, (5, str(tmp_path / "store"), str(tmp_path)), 5)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(5)]
    assert [r["group"] for r in results] == [None, (0, [1, 2], 0), (0, [1, 2], 1), (1, [3, 4], 0), (1, [3, 4], 1)]
    assert [r.get("peak") for r in results[1:]] == [2.0, 2.0, 4.0, 4.0]
    assert all(r["oom"] is None for r in results[1:])  # one rank of each group ran out: both take it
    assert results[1]["disagree"] == "target group 0: its ranks are at different batches (1 .. 2)"
    assert results[4]["disagree"] == "target group 1: its ranks are at different batches (3 .. 4)"
