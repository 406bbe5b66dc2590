"""Batches per optimizer step: --grad-accum is per drafter; a token target is shared out evenly."""

from __future__ import annotations

import argparse

import torch

from draftline.commands.train import add_arguments, config_from_args
from draftline.config import TrainConfig
from draftline.pipeline.spec import default_batches_per_step as grad_accum_batches


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


# ---------------------------------------------------------------- config files: types from the annotations
import json  # noqa: E402

import pytest  # noqa: E402

from draftline.config import apply_dict, field_types, load_config_file, type_name  # noqa: E402
from draftline.errors import DraftlineError  # noqa: E402


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


def test_final_acceptance_settings_flags_defaults_and_checks():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError
    from draftline.pipeline.build import build_evaluation

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "t", "--data", "d", "--out", "o"]
    config = config_from_args(parser.parse_args(base))
    # The final measurement defaults to what `draftline eval` measures: every prompt, 256 tokens.
    assert (config.monitor.eval_final_num_prompts, config.monitor.eval_final_max_new_tokens) == (None, 256)
    config = config_from_args(parser.parse_args([*base, "--eval-num-prompts", "4", "--eval-max-new-tokens", "32",
                                                 "--eval-final-num-prompts", "24", "--eval-final-max-new-tokens", "64"]))
    import torch
    from transformers import Qwen3Config

    from draftline.model.config import build_drafter_config
    from draftline.distributed.shard import DrafterGroup
    from draftline.pipeline.spec import ModelSpec, RunSpec

    target = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = ModelSpec.from_configs(target, build_drafter_config(target, num_hidden_layers=1, block_size=4))
    evaluation = build_evaluation(RunSpec.standalone(config, model, torch.device("cpu")), DrafterGroup(), None)
    assert evaluation.settings(final=False) == (4, 32) and evaluation.settings(final=True) == (24, 64)
    validate(config)
    config.monitor.eval_final_num_prompts = 0
    with pytest.raises(DraftlineError, match="eval_final_num_prompts"):
        validate(config)


def test_grad_accum_and_global_batch_tokens_together_are_refused():
    """Both set the batches of a step; before, --grad-accum was silently ignored."""
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    config = TrainConfig(out="o")
    config.model.target, config.data.data = "t", ["d"]
    config.optim.global_batch_tokens, config.optim.grad_accum = 65536, 2
    with pytest.raises(DraftlineError, match="both set the batches of an optimizer step; pick one"):
        validate(config)
    config.optim.grad_accum = 1
    validate(config)
    config.optim.global_batch_tokens = 0
    with pytest.raises(DraftlineError, match="global_batch_tokens"):
        validate(config)


def test_drafter_state_flag_and_its_values():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError
    from draftline.distributed.shard import replicates

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o",
                                                 "--drafter-state", "replicate"]))
    assert config.topology.drafter_state == "replicate"
    validate(config)
    assert replicates("replicate", torch.device("cuda")) and not replicates("shard", torch.device("cpu"))
    assert replicates("auto", torch.device("cpu")) and not replicates("auto", torch.device("cuda"))
    config.topology.drafter_state = "mirror"
    with pytest.raises(DraftlineError, match=r"topology.drafter_state \(--drafter-state\) must be auto, shard or replicate"):
        validate(config)
