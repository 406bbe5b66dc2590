"""The drafters' shared training state: one drafter trains alone, several shard theirs with FSDP2.

One drafter: nothing here communicates. The drafter holds its fp32 master weights, gradients and
AdamW moments (16 bytes per trained weight), and a step costs what it always did.

D > 1 drafters hold it in one of two ways (``topology.drafter_state``).

Sharded (the default on GPU): the drafter is sharded with torch's FSDP2 (``fully_shard``, one unit per decoder
layer, one per head a method adds (DSpark's Markov and confidence heads: ``drafter.heads()``) and one for ``fc``
and the norms) over the drafter ranks. Each rank holds 1/D of the fp32
master weights, of the gradients and of the AdamW moments; the compute weights (bf16 on GPU) are
gathered layer by layer for the forward and again for the backward, and each pass's gradients are
reduce-scattered in fp32 as a sum (``set_force_sum_reduction_for_comms``: the step's gradient is the
sum over its batches, divided by the step's label weight afterwards, as with one drafter).

FSDP's collectives must line up across the ranks, so every drafter runs the same number of passes
in a step: ``agree_max`` takes the busiest drafter's count (one small all-reduce on the host, over
gloo: no GPU sync), and the others add empty passes that add nothing to any gradient. The step's
metrics vector (loss sums, counts, the stop and save flags, each rank's share of the squared
gradient norm) is summed in one more all-reduce. Checkpoints use ``torch.distributed.checkpoint``,
which writes each rank's shards and loads them on any number of drafters (``checkpoint/state.py``).

Replicated (the default on CPU): every drafter holds the whole drafter, its gradients and AdamW
moments, as one drafter alone does. The first drafter's weights are broadcast at the start; each
drafter runs its own passes (no empty ones); ``reduce_gradients`` sums the step's gradients over the
drafters in one all-reduce of one flat buffer, and every drafter takes the same AdamW step on the same
sum, so their weights stay equal bit for bit (gloo's ring all-reduce hands every rank the same bytes).
On CPU, FSDP's per-layer gathers over gloo cost more than the step they shard: the demo's colocated
2-process line trained at 2.23 Ktok/s sharded and 4.30 replicated (docs/benchmarks/2026-12-demo-cpu-line.md). The checkpoint
is the same ``torch.distributed.checkpoint`` state, written once (its planner drops the copies), so a
run resumes on any number of drafters either way.

Who waits here: every drafter waits for the slowest at the first gather of each pass and at the
step's all-reduce; all of these waits poll ``Health`` (directly, or through the layers' progress
hooks) so that a dead drafter ends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftline.checkpoint.state import whole_weights
from draftline.distributed.health import Health
from draftline.distributed.waits import wait_work


@dataclass
class DrafterGroup:
    """This drafter's place among the drafters, and their process groups (None with one drafter)."""

    num_drafters: int = 1
    index: int = 0
    device_group: object = None
    """The drafters' group on the device's backend (NCCL on GPU): FSDP's gathers and reduce-scatters, the
    step's all-reduce."""
    host_group: object = None
    """The drafters' gloo group for small host-side agreements (pass counts, barriers), main thread only."""
    checkpoint_group: object = None
    """The drafters' gloo group for ``torch.distributed.checkpoint`` (its writes run in a background thread).
    With one drafter among several ranks, a group of that rank alone; None in a single process."""
    health: Health | None = None
    replicated: bool = False
    """Several drafters, each holding the whole drafter (``topology.drafter_state`` 'replicate'; never with
    one drafter)."""

    @property
    def several(self) -> bool:
        """More than one drafter: the step's metrics, flags and barriers are agreed among them."""
        return self.num_drafters > 1

    @property
    def sharded(self) -> bool:
        """Several drafters sharding the drafter with FSDP2: every pass is collective."""
        return self.num_drafters > 1 and not self.replicated

    @property
    def is_first(self) -> bool:
        return self.index == 0

    # ------------------------------------------------------------------ sharding
    def shard(self, drafter: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
        """Shard ``drafter`` in place over the drafters; replicated, give every drafter the first one's weights
        (nothing with one drafter)."""
        if self.replicated:
            first = dist.get_global_rank(self.device_group, 0)
            with torch.no_grad():
                for tensor in drafter.state_dict().values():
                    wait_work(dist.broadcast(tensor, src=first, group=self.device_group, async_op=True), self.health)
            return
        if not self.sharded:
            return
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(self.device_group, device.type)
        policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                      reduce_dtype=torch.float32)
        # A method's heads (DSpark's) run after the backbone's forward, each in its own module call: their own
        # units, gathered for that call and its backward (as a root's parameters, they would be used outside
        # the forward that gathered them).
        units = [*drafter.layers, *drafter.heads(), drafter]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)

    # ------------------------------------------------------------------ agreements
    def agree_max(self, count: int) -> int:
        """The largest ``count`` of any drafter (the most passes of a step, any drafter's flag): a small
        all-reduce on the host (``count`` itself with one drafter)."""
        if not self.several:
            return count
        value = torch.tensor([count], dtype=torch.int64)
        wait_work(dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True), self.health)
        return int(value)

    def all_reduce(self, vector: torch.Tensor) -> torch.Tensor:
        """Sum ``vector`` over the drafters, in place (nothing with one drafter)."""
        if self.several:
            wait_work(dist.all_reduce(vector, group=self.device_group, async_op=True), self.health)
        return vector

    def barrier(self) -> None:
        """Every drafter reaches this point (while one evaluates, the others wait here, polling health)."""
        if self.several:
            self.agree_max(0)

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Replicated drafters: sum every gradient over the drafters, in one all-reduce of one flat buffer
        (sharded, FSDP reduce-scattered them in each pass already; one drafter: nothing to do). Every drafter
        calls it at every step, also one dealt no batch (its gradients are zeros)."""
        if not self.replicated:
            return
        for p in params:  # a drafter without a batch in this step (the last one) adds zeros: every drafter all-reduces
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        wait_work(dist.all_reduce(flat, group=self.device_group, async_op=True), self.health)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # ------------------------------------------------------------------ whole weights
    def full_weights(self, drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The drafter's whole fp32 weights on the host: on the first drafter (the others get an empty dict;
        every drafter must call this: sharded, it gathers)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.sharded:
            return whole_weights(drafter) if self.is_first else {}
        state = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: t.float() for name, t in state.items()} if self.is_first else {}


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def replicates(drafter_state: str, device: torch.device) -> bool:
    """Whether several drafters replicate the drafter (``topology.drafter_state``; 'auto': on CPU)."""
    return drafter_state == "replicate" or (drafter_state == "auto" and device.type != "cuda")


def make_drafter_group(ranks: list[int], index: int, device: torch.device, health: Health | None,
                       world_size: int, *, replicate: bool = False) -> DrafterGroup:
    """The drafters' process groups; every rank of the job must call this (creating a group is collective).
    ``replicate``: every drafter holds the whole drafter (``replicates``)."""
    if world_size == 1:
        return DrafterGroup(1, 0, health=health)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_group = dist.new_group(ranks, backend=backend)
    host_group = dist.new_group(ranks, backend="gloo")
    checkpoint_group = dist.new_group(ranks, backend="gloo")
    return DrafterGroup(len(ranks), index, device_group, host_group, checkpoint_group, health,
                        replicate and len(ranks) > 1)
