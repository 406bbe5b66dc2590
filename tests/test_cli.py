"""``--help`` explains every option of every command; train's comes from the config's docstrings."""

from __future__ import annotations

import dataclasses
import re

import pytest

from draftline.cli import COMMANDS, command_parser, main
from draftline.config import TrainConfig
from draftline.config_options import option
from draftline.config_docs import field_docs


def _options(parser):
    return [a for a in parser._actions if a.option_strings != ["-h", "--help"]]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_of_every_command_is_explained_in_words(name):
    _, parser = command_parser(name)
    for action in _options(parser):
        label = "/".join(action.option_strings) or action.dest
        own = _words(label + " " + action.dest)
        beyond = _words(action.help or "") - own - {"a", "the", "of", "default", "none", "and", "or", "to"}
        assert len(beyond) >= 4, f"draftline {name} {label}: help {action.help!r} says too little"


def _flat(text: str) -> str:
    return re.sub(r"-\s+", "-", " ".join(text.replace("%%", "%").split()))  # argparse wraps after hyphens


def test_train_help_shows_every_config_fields_docstring_in_its_sections_group():
    _, parser = command_parser("train")
    help_text = _flat(parser.format_help())
    config = TrainConfig()
    groups = {group.title: group for group in parser._action_groups}
    for section in (f.name for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))):
        group = groups[f"[{section}]"]
        for field in dataclasses.fields(getattr(config, section)):
            doc = field_docs(type(getattr(config, section))).get(field.name)
            assert doc, f"{section}.{field.name} has no docstring in draftline/config.py"
            flag = option(field).flag
            if flag is None:  # set from a config file only
                continue
            action = next(a for a in parser._actions if flag in a.option_strings)
            assert action in group._group_actions, f"{flag} is not in the [{section}] group"
            assert _flat(doc) in help_text, f"{flag}: the docstring of {section}.{field.name} is not in --help"
            assert f"[{section}] {field.name}" in _flat(action.help)
    assert _flat(field_docs(TrainConfig)["out"]) in help_text


def test_help_is_printed_and_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--max-anchors ANCHORS" in out and "Anchors (draft blocks) sampled per document" in out
    assert "default: 512" in out


def test_a_config_field_flag_parses_to_its_type():
    from draftline.commands.train import config_from_args

    _, parser = command_parser("train")
    args = parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--betas", "0.8,0.99",
                              "--sort-window", "64", "--max-bad-steps", "3", "--gpus", "2"])
    config = config_from_args(args)
    assert config.optim.betas == (0.8, 0.99) and config.data.sort_window == 64 and config.optim.max_bad_steps == 3
    assert config.topology.gpus == 2
