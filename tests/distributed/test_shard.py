"""Sharding a drafter with heads (DSpark's) over CPU ranks (gloo, FSDP2): each head is a unit of its own, held
1/D outside its call and whole inside it, and a pass split over two ranks gives one process's gradients.

Each rank builds the same DSpark drafter (gated Markov head and confidence head: every head's weight in use),
shards it with ``DrafterGroup.shard`` and runs the objective on its half of the anchors; FSDP2 reduce-scatters
the summed gradients. The whole gradients, gathered, must equal one process's on all the anchors. A head left in
the root unit would also be correct (the root keeps its weights gathered from its forward through backward, at
the memory cost of every head's whole weights for the whole pass), so the units themselves are checked too.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from draftline.data.batch import PackedBatch
from helpers import make_dspark_drafter, tiny_target_config
from parallel_helpers import start_ranks

pytestmark = pytest.mark.slow

DOCS = [(list(range(3, 40)), [i >= 4 for i in range(37)]), (list(range(10, 50, 2)), [True] * 20)]


def _objective(drafter):
    from draftline.objective.dspark import DSparkObjective
    from draftline.objective.loss import ObjectiveSettings

    torch.manual_seed(1)
    config = drafter.config
    embed = torch.randn(config.vocab_size, config.hidden_size) * 0.5
    head = torch.randn(config.vocab_size, config.hidden_size) * 0.5
    return DSparkObjective(drafter, embed, head, ObjectiveSettings(max_anchors=6, attention="dense"))


def _grads(drafter, objective, batch, features, anchors) -> float:
    blocks = objective.build(batch, anchors)
    loss_sum, _ = objective(features, blocks)
    loss_sum.backward()
    return float(loss_sum.detach())


def _rank(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from draftline.distributed.shard import DrafterGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ranks = list(range(world))
        group = DrafterGroup(world, rank, dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo"),
                             dist.new_group(ranks, backend="gloo"))
        drafter = make_dspark_drafter(tiny_target_config(), markov_rank=8, markov_head_type="gated", std=0.2)
        group.shard(drafter, torch.device("cpu"), torch.float32)
        inside = {}

        def record(module, args):  # after FSDP's own pre-forward hook: the weights it gathered
            inside.setdefault(type(module).__name__.removeprefix("FSDP"), [tuple(p.shape) for p in module.parameters()])

        for head in drafter.heads():
            head.register_forward_pre_hook(record)
        held = {name: (p.to_local().shape[0], p.shape[0]) for name, p in drafter.named_parameters()
                if name.startswith(("markov_head.", "confidence_head."))}
        batch = PackedBatch.from_documents(DOCS)
        features = torch.randn(batch.num_tokens, 3 * drafter.config.hidden_size,  # 2 feature layers + the final hidden state
                           generator=torch.Generator().manual_seed(2))
        anchors = torch.tensor([5, 9, 14, 20, 40, 47])
        mine = anchors[rank::world]
        loss = _grads(drafter, _objective(drafter), batch, features, mine)
        grads = {name: p.grad.full_tensor() for name, p in drafter.named_parameters() if p.grad is not None}
        torch.save({"units": [isinstance(h, FSDPModule) for h in drafter.heads()], "held": held, "inside": inside,
                    "grads": grads, "loss": loss}, Path(out) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_heads_are_units_of_their_own_and_two_ranks_give_one_process_gradients(tmp_path):
    world = 2
    start_ranks(_rank, (world, str(tmp_path / "store"), str(tmp_path)), world)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]

    drafter = make_dspark_drafter(tiny_target_config(), markov_rank=8, markov_head_type="gated", std=0.2)
    batch = PackedBatch.from_documents(DOCS)
    features = torch.randn(batch.num_tokens, 3 * drafter.config.hidden_size,  # 2 feature layers + the final hidden state
                           generator=torch.Generator().manual_seed(2))
    loss = _grads(drafter, _objective(drafter), batch, features, torch.tensor([5, 9, 14, 20, 40, 47]))
    reference = {name: p.grad for name, p in drafter.named_parameters() if p.grad is not None}

    for result in results:
        assert result["units"] == [True, True]  # the Markov head and the confidence head: FSDP units
        # Outside its call each rank holds its half of a head's rows (one row of the confidence head's [1, H + r]
        # weight: rank 0 holds it, rank 1 an empty shard), inside it the whole weight.
        vocab = drafter.config.vocab_size
        assert result["held"]["markov_head.markov_w1.weight"] == (vocab // world, vocab)
        assert result["held"]["markov_head.markov_w2.weight"] == (vocab // world, vocab)
        assert result["inside"]["MarkovHead"] == [(vocab, 8), (vocab, 8), (8, 32 + 8), (8,)]
        assert result["inside"]["ConfidenceHead"] == [(1, 32 + 8), (1,)]
        assert result["grads"].keys() == reference.keys()
        for name, grad in reference.items():
            # fp32 sums in another order: within 1e-5 of the tensor's largest entry (a lost or doubled share: 1e-1)
            assert float((result["grads"][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name
    assert sum(r["loss"] for r in results) == pytest.approx(loss, rel=1e-6)
    assert any(name.startswith("markov_head.") for name in reference)
