"""Config files (TOML, JSON) and the command line: each value checked against its field's annotation."""

from __future__ import annotations

import argparse
import json

import pytest

from draftline.commands.train import add_arguments, config_from_args
from draftline.config import TrainConfig
from draftline.config_io import apply_dict, field_types, load_config_file, type_name
from draftline.errors import DraftlineError


def _from_file(tmp_path, text: str, suffix: str = ".toml", argv=()):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *argv]))


def test_toml_and_json_files_give_the_same_typed_config(tmp_path):
    toml = _from_file(tmp_path, """
out = "runs/a"
[model]
target = "t"
target_layer_ids = [1, 5, 9]
[data]
data = "d"
token_budget = 3.2e4
epochs = 3
[optim]
lr = 3e-4
betas = [0.8, 0.99]
loss_gamma = 7
[engine]
preflight = false
""")
    as_json = _from_file(tmp_path, json.dumps({"out": "runs/a", "model": {"target": "t", "target_layer_ids": [1, 5, 9]},
                                               "data": {"data": ["d"], "token_budget": 32000, "epochs": 3},
                                               "optim": {"lr": 3e-4, "betas": [0.8, 0.99], "loss_gamma": 7},
                                               "engine": {"preflight": False}}), ".json")
    assert toml.to_dict() == as_json.to_dict()
    assert toml.data.data == ["d"] and toml.data.token_budget == 32000 and isinstance(toml.data.token_budget, int)
    assert toml.optim.betas == (0.8, 0.99) and toml.optim.loss_gamma == 7.0 and isinstance(toml.optim.loss_gamma, float)
    assert toml.model.target_layer_ids == [1, 5, 9] and toml.engine.preflight is False


def test_flags_override_the_file(tmp_path):
    config = _from_file(tmp_path, '[optim]\nlr = 1e-3\n[data]\nepochs = 2\n', argv=["--lr", "2e-3", "--target-layer-ids", "1,2"])
    assert config.optim.lr == 2e-3 and config.data.epochs == 2 and config.model.target_layer_ids == [1, 2]


@pytest.mark.parametrize("text, message", [
    ('[optim]\nlr = "6e-4"', r"run\.toml: optim\.lr must be float, got the string '6e-4'; write it without quotes"),
    ("[data]\nepochs = 2.5", r"data\.epochs must be int, got 2\.5 \(float\); it must be a whole number"),
    ("[data]\nepochs = true", r"data\.epochs must be int, got True \(bool\)"),
    ("[engine]\npreflight = 1", r"engine\.preflight must be bool, got 1 \(int\)"),
    ("[model]\ntarget_layer_ids = [1, \"2\"]", r"model\.target_layer_ids must be list\[int\] or None, got \[1, '2'\]"),
    ("[optim]\nbetas = [0.9]", r"optim\.betas must be tuple\[float, float\], got \[0\.9\]"),
    ("[optim]\nlrr = 1e-3", r"unknown field optim\.lrr \(did you mean optim\.lr\?\)"),
    ("[data]\nlr = 1e-3", r"unknown field data\.lr \(it is a field of \[optim\]: did you mean optim\.lr\?\)"),
    ("[optimizer]\nlr = 1e-3", r"unknown section 'optimizer' \(did you mean optim\?\)"),
    ("out = 5", r"out must be str, got 5"),
    ("[optim]\nlr = [", r"run\.toml: invalid TOML"),
])
def test_file_errors_name_the_key_the_type_and_the_value(tmp_path, text, message):
    with pytest.raises(DraftlineError, match=message):
        _from_file(tmp_path, text)


def test_json_file_errors_too(tmp_path):
    with pytest.raises(DraftlineError, match=r"run\.json: optim\.lr must be float, got the string '6e-4'"):
        _from_file(tmp_path, '{"optim": {"lr": "6e-4"}}', ".json")
    with pytest.raises(DraftlineError, match=r"run\.json: invalid JSON at line 1"):
        _from_file(tmp_path, '{"optim": ', ".json")
    with pytest.raises(DraftlineError, match=r"expected a table of sections"):
        apply_dict(TrainConfig(), [1, 2], "x.json")
    with pytest.raises(DraftlineError, match=r"config files are \.toml or \.json"):
        load_config_file(_write(tmp_path / "run.yaml", "a: 1"))


def _write(path, text):
    path.write_text(text)
    return path


def test_every_field_has_a_checked_type_and_the_cli_reports_errors_without_traceback(tmp_path, capsys):
    config = TrainConfig()
    for section in ("model", "data", "optim", "topology", "checkpoint", "monitor", "engine"):
        for name, hint in field_types(type(getattr(config, section))).items():
            apply_dict(config, {section: {name: getattr(getattr(config, section), name)}}, "defaults")  # each default passes
            assert type_name(hint)
    from draftline.cli import main

    code = main(["train", "--config", str(_write(tmp_path / "bad.toml", "[data]\nepochs = 2.5\n")), "--target", "t",
                 "--data", "d", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "data.epochs must be int, got 2.5" in err and "Traceback" not in err
