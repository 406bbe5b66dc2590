"""Role assignment is a pure function of the world size and the requested split."""

from __future__ import annotations

import pytest

from draftline.distributed.roles import assign_roles, producer_of, split
from draftline.errors import DraftlineError


def test_one_process_is_colocated():
    (role,) = assign_roles(1, 1, 1)
    assert role.kind == "colocated" and role.is_target and role.is_drafter and role.is_logging
    assert split(1, None, None) == (1, 1)
    with pytest.raises(DraftlineError, match="needs that many processes"):
        split(1, 2, 1)


def test_drafters_first_then_targets():
    roles = assign_roles(8, 7, 1)
    assert [r.kind for r in roles] == ["drafter"] + ["target"] * 7
    assert roles[0].is_logging and not roles[1].is_logging
    assert [roles[0].target_rank(i) for i in range(7)] == list(range(1, 8))
    assert roles[3].index == 2


@pytest.mark.parametrize("world,targets,drafters,expected", [
    (8, 7, None, (7, 1)), (8, None, 3, (5, 3)), (4, 2, 2, (2, 2)),
])
def test_split_fills_in_the_other_count(world, targets, drafters, expected):
    assert split(world, targets, drafters) == expected


def test_split_from_work_share_and_bad_splits():
    assert split(8, None, None, target_share=1 / 3) == (3, 5)  # 8B-class: drafters cost twice as much
    assert split(8, None, None, target_share=0.99) == (7, 1)  # never zero drafters
    with pytest.raises(DraftlineError, match="must add up to the 8 launched processes"):
        split(8, 3, 3)
    with pytest.raises(DraftlineError):
        split(4, 4, None)


def test_targets_take_batches_round_robin():
    assert [producer_of(s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_colocated_ranks_each_run_both():
    roles = assign_roles(3, *split(3, None, None, colocated=True), colocated=True)
    assert [r.kind for r in roles] == ["colocated"] * 3
    assert [r.index for r in roles] == [0, 1, 2] and roles[0].is_logging and not roles[2].is_logging
    assert roles[0].drafter_ranks == [0, 1, 2] and roles[1].target_rank(1) == 1
    with pytest.raises(DraftlineError, match="drop --targets"):
        split(4, 2, None, colocated=True)


def test_each_step_is_dealt_to_every_drafter():
    # Steps hold a multiple of the drafters' count, so round robin gives each drafter an equal
    # share of every step: no drafter waits on another's whole step.
    from draftline.config import TrainConfig
    from draftline.pipeline.spec import default_batches_per_step as grad_accum_batches

    config = TrainConfig()
    config.optim.grad_accum = 2
    per_step = grad_accum_batches(config, 3)
    for step in range(4):
        owners = [producer_of(seq, 3) for seq in range(step * per_step, (step + 1) * per_step)]
        assert sorted(owners) == [0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------------------------------------- target groups
def test_target_groups_are_whole_consecutive_ranks_and_send_from_their_first():
    """--gpus 8 --targets 6 --target-parallel 2: drafters 0-1, three targets of two ranks; batches round robin to the
    groups, each group's first rank sends its features; messages name the group and the rank in it."""
    roles = assign_roles(8, *split(8, 6, None, target_parallel=2), target_parallel=2)
    assert [r.kind for r in roles] == ["drafter"] * 2 + ["target"] * 6
    first = roles[0]
    assert first.num_target_groups == 3 and first.all_target_groups() == [[2, 3], [4, 5], [6, 7]]
    assert [first.sender_rank(producer_of(seq, first.num_target_groups)) for seq in range(6)] == [2, 4, 6, 2, 4, 6]
    assert [r.target_group for r in roles] == [None, None, 0, 0, 1, 1, 2, 2]
    assert [r.sends for r in roles] == [False, False, True, False, True, False, True, False]
    assert roles[5].describe_group() == "target group 1, its rank 1 of 2" and roles[0].describe_group() == ""


@pytest.mark.parametrize("world,targets", [(2, 1), (3, 2), (8, 5), (8, 7)])
def test_one_rank_per_target_keeps_the_arithmetic_of_a_rank_per_target(world, targets):
    """--target-parallel 1: group g is target g, its sender that target's rank, nothing described."""
    roles = assign_roles(world, targets, world - targets)
    for role in roles:
        assert role.target_parallel == 1 and role.num_target_groups == role.num_targets and role.describe_group() == ""
        for seq in range(3 * targets):
            assert role.sender_rank(producer_of(seq, role.num_target_groups)) == role.target_rank(
                producer_of(seq, role.num_targets))
        if role.kind == "target":
            assert role.sends and role.target_group == role.index and role.all_target_groups() == [
                [t] for t in range(world - targets, world)]


def test_split_into_target_groups_and_what_cannot_be():
    assert split(8, 6, None, target_parallel=2) == (6, 2)
    assert split(8, None, 2, target_parallel=2) == (6, 2)
    assert split(8, None, None, target_share=0.55, target_parallel=2) == (4, 4)  # 4.4 target ranks: 2 groups
    assert split(8, None, None, target_share=0.99, target_parallel=2) == (6, 2)  # never zero drafters
    assert split(8, None, None, target_share=0.01, target_parallel=4) == (4, 4)  # at least one group
    assert split(4, None, None, colocated=True, target_parallel=2) == (4, 4)
    with pytest.raises(DraftlineError, match="cannot form target groups of --target-parallel 2"):
        split(8, None, 3, target_parallel=2)
    with pytest.raises(DraftlineError, match="one process holds a whole target: launch with --gpus N"):
        split(1, None, None, target_parallel=2)
    with pytest.raises(DraftlineError, match="leaves no rank for a drafter"):
        split(2, None, None, target_parallel=2)
    with pytest.raises(DraftlineError, match="must be a multiple of 4"):
        split(6, None, None, colocated=True, target_parallel=4)


def test_a_colocated_group_computes_its_drafters_batches_and_each_rank_keeps_its_own():
    """4 colocated ranks in groups of 2, 8 batches a step: each group computes its two drafters' shares, step by
    step; what a rank keeps (``drafter_of``) is exactly its drafter's share, and the groups cover every batch once."""
    from draftline.distributed.roles import drafter_of, drafter_seqs, group_seqs

    roles = assign_roles(4, *split(4, None, None, colocated=True, target_parallel=2), colocated=True,
                         target_parallel=2)
    assert [r.target_group for r in roles] == [0, 0, 1, 1] and roles[2].group_ranks(1) == [2, 3]
    per_group = {g: list(group_seqs(1, 4, 8, 30, roles[0].group_ranks(g), 4)) for g in (0, 1)}
    assert per_group[0][:4] == [8, 9, 12, 13] and per_group[1][:4] == [10, 11, 14, 15]
    assert sorted(per_group[0] + per_group[1]) == list(range(8, 30))
    for role in roles:
        kept = [s for s in per_group[role.target_group] if drafter_of(s, 8, 4) == role.index]
        assert kept == list(drafter_seqs(1, 4, 8, 30, role.index, 4))


def test_one_rank_per_target_creates_no_target_group():
    """--target-parallel 1 touches nothing of torch.distributed (no process group exists here to touch)."""
    import torch

    from draftline.distributed.target_group import make_target_group

    for role in assign_roles(3, 2, 1):
        assert make_target_group(role, role.rank, torch.device("cpu"), health=None) is None


def test_a_target_group_across_two_nodes_is_found():
    """2 nodes of 8 ranks: groups of 2 or 4 after 4 drafters stay on one node; groups of 3 after 1 drafter put ranks
    7-9 across the two (train refuses that, naming the ranks)."""
    from draftline.distributed.roles import groups_across_nodes

    assert groups_across_nodes(assign_roles(16, 12, 4, target_parallel=2)[0], 8) == []
    assert groups_across_nodes(assign_roles(16, 12, 4, target_parallel=4)[0], 8) == []
    assert groups_across_nodes(assign_roles(16, 15, 1, target_parallel=3)[0], 8) == [[7, 8, 9]]
    assert groups_across_nodes(assign_roles(16, 15, 1, target_parallel=3)[0], 16) == []
    from draftline.distributed.roles import check_groups_on_nodes

    with pytest.raises(DraftlineError, match="ranks 7-9 span two nodes of 8 ranks.*--drafters a multiple of "
                                             "--target-parallel 3"):
        check_groups_on_nodes(assign_roles(16, 15, 1, target_parallel=3)[0], 8)
