"""metrics.jsonl, TensorBoard, W&B's missing-package error, the null logger."""

from __future__ import annotations

import importlib.util
import json

import pytest

from draftline.errors import DraftlineError
from draftline.monitor.loggers import JsonlLogger, NullLogger, flatten_scalars, open_loggers


def test_jsonl_appends_valid_json(tmp_path, busy_status):
    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    logger.log({"kind": "start", "mode": "fresh", "step": 0, "time": 1.0, "elapsed_s": 0.0})
    logger.log(busy_status.to_record())
    # Flushed per line: readable before close.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    logger.close()
    again = JsonlLogger(tmp_path / "metrics.jsonl")
    again.log({"kind": "end", "step": 1234, "status": "finished", "reason": "", "time": 2.0, "elapsed_s": 1.0})
    again.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start", "train", "end"]
    train = records[1]
    assert train["accuracy_by_position"][3] is None  # NaN is written as null: strict JSON
    assert train["gpus"][1]["mem_used_gib"] is None and train["ktok_s"] == 20.2


def test_flatten_scalars(busy_status):
    scalars = dict(flatten_scalars(busy_status.to_record()))
    assert scalars["loss"] == 2.3456 and scalars["q_pre/1"] == 12.0
    assert scalars["accuracy_by_position/1"] == 0.82  # block slots are numbered from 1
    assert scalars["gpus/0/util"] == 0.97 and "gpus/1/util" not in scalars
    assert "kind" not in scalars and "time" not in scalars and "step" not in scalars
    # TensorBoard gets the measured tau and the teacher-forced figure under its own name.
    assert scalars["tau"] == 1.87 and scalars["tf_acceptance"] == 3.21 and "tau_step" not in scalars


def test_tensorboard_writes_an_event_file(tmp_path, busy_status):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = open_loggers(tmp_path, tensorboard=True)
    logger.log({"kind": "start", "mode": "fresh", "step": 0, "config": {"lr": 6e-4}, "time": 1.0, "elapsed_s": 0.0})
    logger.log(busy_status.to_record())
    logger.close()
    assert (tmp_path / "metrics.jsonl").exists()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/mfu", "train/accuracy_by_position/1", "train/gpus/0/mem_used_gib"} <= tags
    loss = acc.Scalars("train/loss")[0]
    assert loss.step == 1234 and loss.value == pytest.approx(2.3456)


def test_null_logger_for_other_ranks(tmp_path, busy_status):
    logger = open_loggers(tmp_path / "run", is_logging_rank=False)
    assert isinstance(logger, NullLogger)
    logger.log(busy_status.to_record())
    logger.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_says_how_to_fix(tmp_path):
    with pytest.raises(DraftlineError, match="pip install"):
        open_loggers(tmp_path, tensorboard=False, wandb=True)
    assert not (tmp_path / "metrics.jsonl").exists()


class _FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.config, self.finished = init, [], _FakeConfig(), False

    def log(self, values, step=None):
        self.logged.append((values, step))

    def finish(self):
        self.finished = True


class _FakeConfig(dict):
    def update(self, values, allow_val_change=False):
        super().update(values)


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module: the calls W&B's client would get, without an account or a network."""
    import sys
    import types

    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(_FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_the_config_once_and_every_records_scalars_at_its_step(tmp_path, busy_status, fake_wandb):
    logger = open_loggers(tmp_path, tensorboard=False, wandb=True, wandb_project="drafters-q8b")
    (run,) = fake_wandb.runs
    assert run.init == {"project": "drafters-q8b", "dir": str(tmp_path), "config": None}
    logger.log({"kind": "start", "mode": "fresh", "step": 0, "config": {"optim": {"lr": 6e-4}}, "time": 1.0,
                "elapsed_s": 0.0, "topology": {"targets": 1}})
    assert run.config == {"config": {"optim": {"lr": 6e-4}}, "topology": {"targets": 1}, "mode": "fresh"}
    assert run.logged == []  # the start record is config, not a point of a chart
    logger.log(busy_status.to_record())
    logger.log({"kind": "eval", "time": 2.0, "step": 1234, "tau": 2.5, "acceptance_hist": [3, 1]})
    logger.log({"kind": "end", "time": 3.0, "step": 1234, "status": "stopped", "reason": "signal"})
    (train, train_step), (evaluation, eval_step) = run.logged  # the end record has no numbers: nothing sent
    assert train_step == eval_step == 1234
    assert train["train/loss"] == 2.3456 and train["train/accuracy_by_position/1"] == 0.82
    assert train["train/gpus/0/util"] == 0.97 and train["train/q_pre/1"] == 12.0
    assert "train/step" not in train and "train/layout/targets" not in train
    assert evaluation == {"eval/tau": 2.5, "eval/acceptance_hist/1": 3.0, "eval/acceptance_hist/2": 1.0}
    assert (tmp_path / "metrics.jsonl").is_file()  # the JSONL log is kept beside W&B
    logger.close()
    assert run.finished
