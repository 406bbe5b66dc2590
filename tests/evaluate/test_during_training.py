"""evaluate/during_training.py: when acceptance is measured during training, and what running out of memory does."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from draftline.config import TrainConfig
from draftline.distributed.shard import DrafterGroup
from draftline.evaluate.during_training import InTrainingEvaluation, eval_interval
from draftline.methods import get_method
from draftline.model.config import build_drafter_config


def test_the_cadence():
    assert eval_interval(None, 665) == 66 and eval_interval(None, 5) == 1 and eval_interval(None, 0) == 0
    assert eval_interval(0, 665) == 0 and eval_interval(25, 665) == 25
    with pytest.raises(ValueError, match="eval_every"):
        eval_interval(-1, 10)


def _evaluation(eval_every=None, total_steps=100):
    target = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config = TrainConfig()
    config.monitor.eval_every = eval_every
    evaluation = InTrainingEvaluation(config.monitor, total_steps=total_steps, target="unused", dataset=None,
                                      drafter_config=build_drafter_config(target, num_hidden_layers=1, block_size=4),
                                      method=get_method("dflash"),
                                      device=torch.device("cpu"), dtype=torch.float32, group=DrafterGroup(), logger=None)
    return evaluation, config


def test_due_every_interval_and_never_at_the_last_step():
    evaluation, _ = _evaluation(eval_every=25, total_steps=100)
    assert [s for s in range(1, 101) if evaluation.due(s)] == [25, 50, 75]  # the end has its own, final one
    assert not any(_evaluation(eval_every=0)[0].due(s) for s in range(1, 101))


def test_running_out_of_memory_turns_the_measurements_during_the_run_off_and_leaves_the_config(monkeypatch):
    evaluation, config = _evaluation(eval_every=10)
    monkeypatch.setattr(evaluation, "_measure", lambda drafter, step, final: {"tau": 2.0, "step": step})
    assert evaluation.during(None, 10) == {"tau": 2.0, "step": 10} and evaluation.due(20)

    def out_of_memory(drafter, step, final):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(evaluation, "_measure", out_of_memory)
    assert evaluation.during(None, 20) is None
    assert not evaluation.due(30) and config.monitor.eval_every == 10  # off, and the config as the user gave it
    with pytest.raises(torch.OutOfMemoryError):  # the final measurement's failure is the run's
        evaluation.final(None, 100)

    monkeypatch.setattr(evaluation, "_measure", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError):  # anything else is a real failure
        evaluation.during(None, 40)
