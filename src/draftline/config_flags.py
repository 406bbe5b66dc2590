"""The config as command-line flags, each made from its field's declaration.

A field declared with flags (``opt`` in ``draftline.config``) becomes an option of its section's group:
its type from the annotation (int, float, str as such; a list or tuple comma-separated; a bool a
switch, ``off`` the switch that turns it off), its metavar as declared (else the type's, or the field's
choices), its help the docstring under the field (``draftline.config_docs``) followed by where it lives in
a config file and its default. A ``train`` option defaults to None: a flag given overrides the config
file, one not given leaves it.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from draftline.config import TrainConfig, declared_fields, sections
from draftline.config_docs import field_docs, section_doc
from draftline.config_io import apply_dict, field_types, load_config_file
from draftline.config_options import OneOf, Option, option


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help strings with %


def _section_class(section: str) -> type:
    return sections()[section] if section else TrainConfig


def _declared(section: str, name: str) -> tuple[Option, Any]:
    """The field's ``Option`` and its default."""
    found = option(_section_class(section).__dataclass_fields__[name])
    assert found is not None, f"{section}.{name} is not declared with opt()"
    return found, getattr(_section_class(section)(), name)


def _shown(value: Any) -> str:
    return "none" if value is None else ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _where(section: str, name: str, switch: str | None) -> str:
    """Where the field lives in a config file and its default; for a switch, the value it sets."""
    declared, default = _declared(section, name)
    if not section:
        return f"{name}, at the top of a config file"
    key = f"[{section}] {name}"
    if switch is not None:
        sets = "false" if switch == declared.off else "true"
        default_text = {True: "on", False: "off"}.get(default, _shown(default))
        return f"{key} = {sets}; default: {default_text}"
    return key if default in ("", []) else f"{key}; default: {_shown(default)}"


def _flag_type(section: str, name: str):
    """The argparse type of a field's flag, from its annotation (``X | None`` as ``X``)."""
    hint = field_types(_section_class(section))[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return bool
    if typing.get_origin(hint) in (list, tuple):
        item = typing.get_args(hint)[0]
        declared, _ = _declared(section, name)
        if declared.nargs:  # one value per argument (--data DIR DIR)
            return item
        # comma-separated; a tuple's length is checked with the config file's types (draftline.config_io)

        def comma_list(text: str) -> list:
            try:
                return [item(x) for x in text.split(",")]
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__} values, got {text!r}") from None

        comma_list.__name__ = f"comma-separated {item.__name__} list"
        return comma_list
    assert hint in (int, float, str), f"{section}.{name}: a flag for type {hint} needs a parser here"
    return hint


def _metavar(section: str, name: str, kind: Any) -> str:
    declared, _ = _declared(section, name)
    if declared.metavar:
        return declared.metavar
    if isinstance(declared.check, OneOf):
        return "{" + ",".join(declared.check.choices) + "}"
    return {int: "N", float: "X", str: "VALUE"}.get(kind, "A,B,...")


def _dest(declared: Option) -> str:
    return declared.switches[0].lstrip("-").replace("-", "_")


def add_field_argument(group, section: str, name: str, *, own_help: str | None = None, **kwargs: Any) -> None:
    """The options of field ``section.name`` (section "" for ``out``) on ``group``.

    For ``train``: help from the field's docstring, default None. Another command that takes the same
    value (``plan``'s sizes) passes ``own_help``, what the value means there: the default is then the
    field's own and the help names the field.
    """
    declared, default = _declared(section, name)
    doc = field_docs(_section_class(section)).get(name, "")
    kind = _flag_type(section, name)
    dest = _dest(declared)
    if kind is bool:
        for switch in declared.switches:
            text = doc if switch == declared.switches[0] else f"The opposite of {declared.switches[0]} (see there)."
            if own_help is not None:  # another command's switch: its own meaning, the field's default
                text = own_help if switch == declared.switches[0] else text
                where = f"train's {_where(section, name, switch)}"
            else:
                where = _where(section, name, switch)
            group.add_argument(switch, dest=dest, action="store_false" if switch == declared.off else "store_true",
                               default=default if own_help is not None else None, help=_escape(f"{text} ({where})"))
        return
    if own_help is not None:
        kwargs.setdefault("default", default)
        help_text = _escape(f"{own_help} (train's {_where(section, name, None)})")
    else:
        help_text = _escape(f"{doc} ({_where(section, name, None)})" if doc else f"({_where(section, name, None)})")
    group.add_argument(*declared.flags, dest=dest, type=kind, nargs=declared.nargs,
                       metavar=_metavar(section, name, kind), help=help_text, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``--config``, ``--out`` and every declared field's options, a group per config section (its
    docstring the group's text), in the config's order; the groups by section name."""
    run_group = parser.add_argument_group("run", "The config file and the run directory.")
    run_group.add_argument("--config", metavar="FILE",
                           help="a TOML or JSON file with [model], [data], [optim], ... sections (the fields "
                                "below); flags given as well override it")
    groups = {"": run_group}
    for section, cls in sections().items():
        about = section_doc(cls).removeprefix(f"[{section}]").strip()
        groups[section] = parser.add_argument_group(f"[{section}]", _escape(about))
    for section, _, field in declared_fields():
        if option(field).switches:
            add_field_argument(groups[section], section, field.name)
    return groups


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the flags given."""
    config = TrainConfig()
    if args.config:
        apply_dict(config, load_config_file(args.config), args.config)
    overrides: dict[str, Any] = {}
    for section, _, field in declared_fields():
        declared = option(field)
        value = getattr(args, _dest(declared)) if declared.switches else None
        if value is None:
            continue
        if section:
            overrides.setdefault(section, {})[field.name] = value
        else:
            overrides[field.name] = value
    apply_dict(config, overrides, "command line")
    return config
