"""A target group: the K ranks that run one target tensor-parallel (``--target-parallel K``), and its agreements.

With K = 1 there is no group: ``make_target_group`` returns None before touching ``torch.distributed``, and the
target's code path is the one of a rank per target (no process group, no collective). With K > 1 every rank of the
job creates every group's two process groups, in group order (creating one is collective over the whole job):

- ``device_group`` (NCCL on GPU, gloo on CPU): the target's own all-reduces (``model/target_parallel.py``);
- ``host_group`` (gloo): the group's agreement before each batch (``agree_next``): one all-reduce of two integers on
  the host, waited for while polling ``Health``. The target's all-reduces poll nothing: a rank that stopped (the
  drafters ended the run, a failure) would leave its peers inside one for good. So no rank enters a batch's forward
  before every rank of its group has agreed to run that batch; a rank that stops does so at an agreement, where its
  peers' wait polls the health that names the stop. The agreement also checks that every rank runs the same batch.

Who waits here: every rank of a group waits for the slowest of the group at each batch's agreement (its sender waits
for the drafters' claims, so the whole group follows the drafters' pace) and at each of the forward's all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftline.distributed.health import Health
from draftline.distributed.roles import Role
from draftline.distributed.waits import wait_work

_END = -1
"""The batch number a rank agrees on when its batches are over."""


@dataclass
class TargetGroup:
    """This rank's target group (``index``: the group's index; ``ranks``: its ranks, in group order)."""

    index: int
    ranks: list[int]
    rank_in_group: int
    device_group: object
    host_group: object
    health: Health

    @property
    def size(self) -> int:
        return len(self.ranks)

    def agree_next(self, seq: int | None) -> float:
        """Every rank of the group is about to run batch ``seq`` (None: its batches are over); returns the seconds
        waited for the others. Ranks that disagree are a bug (their forwards would mix two batches): raised."""
        mine = _END if seq is None else seq
        value = torch.tensor([mine, -mine], dtype=torch.int64)
        waited = wait_work(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True),
                           self.health)
        highest, lowest = int(value[0]), -int(value[1])
        if highest != lowest:
            raise RuntimeError(f"target group {self.index}: its ranks are at different batches ({lowest} .. {highest})")
        return waited

    def agree_peak(self, peak: float | None) -> float | None:
        """The largest of the group's measured peaks (None: a rank ran out of memory), so that every rank of the group
        takes the same decision from preflight's measurements."""
        value = torch.tensor([float("inf") if peak is None else peak], dtype=torch.float64)
        wait_work(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True), self.health)
        return None if value.item() == float("inf") else float(value.item())


def make_target_group(role: Role, rank: int, device: torch.device, health: Health) -> TargetGroup | None:
    """This rank's target group, or None (K = 1, or a drafter-only rank). Every rank of the job must call this, after
    the drafters' groups: each rank creates every target group's process groups in the same order."""
    if role.target_parallel == 1:
        return None  # one rank per target: nothing created, nothing agreed (the path of a rank per target)
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = None
    for index, ranks in enumerate(role.all_target_groups()):
        device_group = dist.new_group(ranks, backend=backend)
        host_group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = TargetGroup(index, ranks, ranks.index(rank), device_group, host_group, health)
    return mine
