"""A config read from a file or a dict: each value checked against its field's annotation.

``apply_dict`` sets ``{section: {field: value}}`` (and a top-level ``out``) on a ``TrainConfig``, each
value checked against the field's type with no silent conversions; a wrong key is named with the
nearest valid one. ``load_config_file`` reads such a dict from a TOML or JSON file. The ranges and
choices of a value are ``draftline.config.validate``'s, once the whole config is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

from draftline.errors import DraftlineError

TrainConfig = Any
"""A ``draftline.config.TrainConfig`` (the config module imports this one: named here, not imported)."""


def _sections(config: TrainConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))}


def field_types(section_class: type) -> dict[str, Any]:
    """``{field: annotation}`` of a config section, resolved from the dataclass's annotations."""
    hints = typing.get_type_hints(section_class)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_class)}


def type_name(hint: Any) -> str:
    """How a field's type reads in a message: ``int``, ``list[int] or None``, ``tuple[float, float]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint)).replace("NoneType", "None")
    if typing.get_origin(hint) is not None:
        return f"{typing.get_origin(hint).__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


class _WrongType(Exception):
    pass


def _check(value: Any, hint: Any) -> Any:
    """``value`` as the annotation ``hint`` wants it (a list for a tuple from JSON, 2.0 for an int
    field read as 2.0), or ``_WrongType``. No silent conversions: "6e-4" is not a float, True not an int."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg)
            except _WrongType:
                pass
        raise _WrongType
    if hint in (bool, str):  # exactly that type: 1 is not a bool, nor 6e-4 written in quotes a float
        if isinstance(value, hint):
            return value
        raise _WrongType
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 3.2e4 in TOML is a float
            return int(value)
        raise _WrongType
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _WrongType
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _WrongType
        return [_check(item, args[0]) for item in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _WrongType
        return tuple(_check(item, arg) for item, arg in zip(value, args))
    raise AssertionError(f"config field type {hint} has no check; add one to config_io._check")


def _nearest(name: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _field_elsewhere(name: str, sections: dict[str, Any]) -> str:
    homes = [key for key, section in sections.items() if name in field_types(type(section))]
    return f" (it is a field of [{homes[0]}]: did you mean {homes[0]}.{name}?)" if homes else ""


def set_field(config: TrainConfig, section_name: str, name: str, value: Any, source: str) -> None:
    """Set ``section.name`` after checking ``value`` against the field's annotation; the error
    names the key, the type expected and the value given."""
    section = getattr(config, section_name)
    hint = field_types(type(section))[name]
    if name == "data" and section_name == "data" and isinstance(value, str):
        value = [value]
    try:
        checked = _check(value, hint)
    except _WrongType:
        shown = f"the string {value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
        hint_text = type_name(hint)
        fix = ""
        if isinstance(value, str) and any(t in hint_text for t in ("int", "float")):
            fix = f"; write it without quotes ({name} = {value})"
        elif isinstance(value, float) and "int" in hint_text:
            fix = "; it must be a whole number"
        raise DraftlineError(f"{source}: {section_name}.{name} must be {hint_text}, got {shown}{fix}") from None
    setattr(section, name, checked)


def apply_dict(config: TrainConfig, data: dict[str, Any], source: str) -> None:
    """Set fields from a nested dict ``{section: {field: value}}`` (top-level ``out`` too), each
    checked against its dataclass annotation; unknown keys are named with the nearest valid one."""
    sections = _sections(config)
    if not isinstance(data, dict):
        raise DraftlineError(f"{source}: expected a table of sections ([model], [data], ...), got {type(data).__name__}")
    for key, value in data.items():
        if key == "out":
            if not isinstance(value, str):
                raise DraftlineError(f"{source}: out must be str, got {value!r} ({type(value).__name__})")
            config.out = value
            continue
        if key not in sections:
            raise DraftlineError(f"{source}: unknown section {key!r}{_field_elsewhere(key, sections) or _nearest(key, list(sections))}; "
                                 f"sections are {sorted(sections)} and 'out'")
        if not isinstance(value, dict):
            raise DraftlineError(f"{source}: [{key}] must be a table of fields, got {value!r}")
        names = list(field_types(type(sections[key])))
        for name, item in value.items():
            if name not in names:
                hint = _field_elsewhere(name, sections) or _nearest(name, names, f"{key}.")
                raise DraftlineError(f"{source}: unknown field {key}.{name}{hint}; fields of [{key}] are {sorted(names)}")
            set_field(config, key, name, item, source)


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise DraftlineError(f"{path}: config file not found")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise DraftlineError(f"{path}: invalid TOML ({exc})") from exc
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DraftlineError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from exc
    raise DraftlineError(f"{path}: config files are .toml or .json")

