"""What a rank builds before training: only a prepared dataset is accepted; a resume keeps the checkpoint's batch order."""

from __future__ import annotations

import argparse
import shlex

import pytest

from draftline.checkpoint.state import TrainerState, save_checkpoint
from draftline.commands.prepare import add_arguments
from draftline.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.pipeline.build import resolve_data_dir, resume_training
from draftline.pipeline.optim import build_optimizer, build_scheduler


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


@pytest.mark.parametrize("saved, now, refused", [
    (None, True, True),     # a checkpoint from before data.balance_steps: its order was the plain one
    (None, False, False),
    (True, True, False),
    (True, False, True),
    (False, False, False),
])
def test_resume_keeps_the_batch_order_of_the_checkpoint(qwen3_target, tmp_path, saved, now, refused):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    drafter = DFlashDrafter(config).float()
    optimizer = build_optimizer(drafter, OptimConfig())
    scheduler = build_scheduler(optimizer, OptimConfig(), total_steps=10)
    data = {"token_budget": 2048} if saved is None else {"token_budget": 2048, "balance_steps": saved}
    state = TrainerState(step=3, next_seq=6, in_flight=[], counters={}, config={"data": data})
    path = save_checkpoint(tmp_path, drafter=drafter, optimizer=optimizer, scheduler=scheduler, state=state, keep=1,
                           wait=True)

    def resume(batches_per_step=2):
        return resume_training(str(path), drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                               batches_per_step=batches_per_step, num_drafters=2, balance_steps=now)

    if not refused:
        assert resume() == 3
        return
    with pytest.raises(DraftlineError) as raised:
        resume()
    fix = "without --no-balance-steps" if saved else "with --no-balance-steps"
    assert str(path) in str(raised.value) and f"resume {fix} so the data continues" in str(raised.value)
    if saved is None:
        assert "written before data.balance_steps" in str(raised.value)
