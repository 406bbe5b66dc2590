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
