"""Rank 0 decides how the run starts; the other ranks wait for its answer or its error."""

from __future__ import annotations

import os
import threading

import pytest
import torch.distributed as dist

from draftline.config import DataConfig, ModelConfig, TrainConfig
from draftline.distributed.health import Health, RankInfo, RunAborted
from draftline.distributed.setup import agree_on_setup


def _config(tmp_path, data) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / "run"), model=ModelConfig(target=str(tmp_path / "target")),
                       data=DataConfig(data=[str(data)]))


def _rank(rank: int, store) -> Health:
    return Health(RankInfo(rank, "target", "here", "CPU", os.getpid()), store, world_size=2)


def test_every_rank_gets_rank_0s_setup(tmp_path, line_data):
    store = dist.HashStore()
    config = _config(tmp_path, line_data)
    answers = {}
    waiter = threading.Thread(target=lambda: answers.update(one=agree_on_setup(config, 1, store, _rank(1, store))))
    waiter.start()
    answers["zero"] = agree_on_setup(config, 0, store, _rank(0, store))
    waiter.join(timeout=10)
    assert answers["one"] == answers["zero"]
    assert answers["zero"].mode == "fresh" and answers["zero"].data_dir == str(line_data)
    assert answers["zero"].start_step == 0 and answers["zero"].checkpoint is None


def test_rank_0s_error_stops_the_others_with_its_message(tmp_path):
    store = dist.HashStore()
    config = _config(tmp_path, tmp_path / "chats.jsonl")  # not a prepared dataset
    with pytest.raises(Exception, match="not a prepared dataset"):
        agree_on_setup(config, 0, store, _rank(0, store))
    with pytest.raises(RunAborted, match="rank 0 could not set the run up: .*not a prepared dataset"):
        agree_on_setup(config, 1, store, _rank(1, store))
