"""What a rank builds before training: only a prepared dataset is accepted."""

from __future__ import annotations

import argparse
import shlex

import pytest

from draftline.commands.prepare import add_arguments
from draftline.config import DataConfig, ModelConfig, TrainConfig
from draftline.errors import DraftlineError
from draftline.pipeline.build import resolve_data_dir


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
