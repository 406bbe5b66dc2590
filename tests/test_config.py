"""Batches per optimizer step: --grad-accum is per drafter; a token target is shared out evenly."""

from __future__ import annotations

import argparse

from draftline.commands.train import add_arguments, config_from_args
from draftline.config import TrainConfig, grad_accum_batches


def test_grad_accum_is_per_drafter():
    config = TrainConfig()
    config.optim.grad_accum = 2
    assert [grad_accum_batches(config, d) for d in (1, 2, 7)] == [2, 4, 14]


def test_global_batch_tokens_round_up_to_an_equal_share_per_drafter():
    config = TrainConfig()
    config.data.token_budget = 32768
    config.optim.global_batch_tokens = 100_000  # 4 batches
    assert [grad_accum_batches(config, d) for d in (1, 3, 5)] == [4, 6, 5]


def test_colocated_flag_reaches_the_topology():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--colocated"]))
    assert config.topology.colocated is True
    assert config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o"])).topology.colocated is False


def test_loss_gamma_flag_and_its_check():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--loss-gamma", "2"]))
    assert config.optim.loss_gamma == 2.0
    config.optim.loss_gamma = 0.0
    with pytest.raises(DraftlineError, match="loss_gamma"):
        validate(config)


def test_distill_flag_and_its_range():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--distill", "0.5"]))
    assert config.optim.distill == 0.5
    validate(config)
    config.optim.distill = 1.5
    with pytest.raises(DraftlineError, match=r"--distill\) must be in \[0, 1\]"):
        validate(config)
