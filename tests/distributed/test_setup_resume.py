"""What a rank sets up before training: only a prepared dataset is accepted; a resume keeps the checkpoint's batches per
step, its batch order and its loss weights."""

from __future__ import annotations

import argparse
import shlex

import pytest

from draftline.commands.prepare import add_arguments
from draftline.config import DataConfig, ModelConfig, TrainConfig
from draftline.distributed.setup import decide_setup, resolve_data_dir, saved_loss
from draftline.errors import DraftlineError
from draftline.pipeline.spec import refuse_changed_loss, resumed_batches_per_step


def _config(tmp_path, data) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / "run"), model=ModelConfig(target=str(tmp_path / "target")),
                       data=DataConfig(data=[str(p) for p in data], token_budget=2048))


def test_a_prepared_dataset_is_used_as_is(tmp_path, line_data):
    assert resolve_data_dir(_config(tmp_path, [line_data])) == line_data


def test_unprepared_input_is_refused_with_the_prepare_command(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DraftlineError) as raised:
        resolve_data_dir(_config(tmp_path, [chats]))
    message = str(raised.value)
    assert f"--data {chats} is not a prepared dataset" in message
    assert f"--data {tmp_path / 'run' / 'data'}" in message
    assert not (tmp_path / "run" / "data").exists()  # nothing prepared inside the line
    # The command it gives is one `draftline prepare` accepts, for this input and this run's budget.
    command = shlex.split(message.splitlines()[-1])
    assert command[:2] == ["draftline", "prepare"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(command[2:])
    assert args.input == [str(chats)] and str(args.out) == str(tmp_path / "run" / "data")
    assert args.max_length == 2048


def test_rank_zero_refuses_unprepared_input_before_it_locks_or_makes_the_run_directory(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DraftlineError, match="is not a prepared dataset"):
        decide_setup(_config(tmp_path, [chats]))
    assert not (tmp_path / "run").exists()  # no lock, no run directory left behind by a refused start


@pytest.mark.parametrize("saved, now, refused", [
    (None, True, True),     # a checkpoint from before data.balance_steps: its order was the plain one
    (None, False, False),
    (True, True, False),
    (True, False, True),
    (False, False, False),
])
def test_resume_keeps_the_batch_order_of_the_checkpoint(saved, now, refused):
    def resume():
        return resumed_batches_per_step("ckpt", 2, saved, 2, now, 2, 2)

    if not refused:
        assert resume() == (2, None)
        return
    with pytest.raises(DraftlineError) as raised:
        resume()
    fix = "without --no-balance-steps" if saved else "with --no-balance-steps"
    assert "ckpt" in str(raised.value) and f"resume {fix} so the data continues" in str(raised.value)
    if saved is None:
        assert "written before data.balance_steps" in str(raised.value)


def test_a_resume_keeps_the_checkpoints_batches_per_step_on_another_number_of_drafters():
    per_step, note = resumed_batches_per_step("ckpt", 2, True, 1, True, 1, 2)
    assert per_step == 2 and "written by 2 drafter(s), resumed on 1" in note and "2 per drafter" in note
    assert resumed_batches_per_step("ckpt", 2, True, 3, True, 3, 2)[0] == 2  # two batches over three drafters
    per_step, note = resumed_batches_per_step("ckpt", 4, True, 2, True, 2, 2)
    assert per_step == 4 and "this config alone would give 2" in note


@pytest.mark.parametrize("method,loss,saved", [
    ("dspark", None, "dflash"),   # DSpark's default: its position weights
    ("dspark", "dpace", "dpace"),
    (None, "dflash", "dflash"),
    ("dflash", "dpace", "dpace"),
    ("dflash", None, None),        # DFlash's default was dflash before it became dpace: not known, not compared
])
def test_a_resume_keeps_the_checkpoints_loss_weights(method, loss, saved):
    assert saved_loss({"model": {"method": method}, "optim": {"loss": loss}}) == saved
    for now in ("dflash", "dpace"):
        if saved is None or now == saved:
            refuse_changed_loss("ckpt", saved, now)
            continue
        with pytest.raises(DraftlineError) as raised:
            refuse_changed_loss("ckpt", saved, now)
        assert str(raised.value).startswith(f"ckpt: its run trained with the {saved} loss weights (optim.loss), "
                                            f"this run asks for {now}: resume with --loss {saved}")
