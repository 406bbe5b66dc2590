"""A config field's one declaration: its default, its flags, its metavar and the values it takes.

    token_budget: int = opt(32768, "--token-budget", metavar="TOKENS", check=POSITIVE)
    \"\"\"Tokens packed into one batch ...\"\"\"

``opt`` keeps an ``Option`` in the dataclass field's metadata. ``draftline.config_flags`` makes the
``train`` option from it (its type from the annotation, its help the docstring under the field) and
``draftline.config.validate`` checks the value against it, naming the key and the flag. A bool's
switches: ``flags`` turn it on, ``off`` turns it off (``--no-compile`` for one that is on by default). A field
declared ``opt(default)``, with no flag, is set from a config file only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Within:
    """The range a number must lie in; a bound is included unless marked open."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def allows(self, value: Any) -> bool:
        if not isinstance(value, (int, float)):  # None where a number must be
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:  # as a message says it: "> 0", ">= 2", "in [0, 1)"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class OneOf:
    """The words a string field takes."""

    choices: tuple[str, ...]

    def allows(self, value: Any) -> bool:
        return value in self.choices

    def __str__(self) -> str:  # "auto, cuda or cpu"
        return f"{', '.join(self.choices[:-1])} or {self.choices[-1]}"


POSITIVE = Within(0, low_open=True)
NON_NEGATIVE = Within(0)
FRACTION = Within(0, 1)


@dataclass(frozen=True)
class Option:
    """What ``opt`` declares beside the default (see the module docstring)."""

    flags: tuple[str, ...] = ()
    off: str | None = None
    metavar: str | None = None
    nargs: str | None = None
    check: Within | OneOf | None = None

    @property
    def switches(self) -> tuple[str, ...]:
        """Every flag of the field: its flag and aliases, then its off-switch."""
        return self.flags + ((self.off,) if self.off else ())

    @property
    def flag(self) -> str | None:
        """The flag a message names the field by."""
        return self.switches[0] if self.switches else None


def opt(default: T, *flags: str, off: str | None = None, metavar: str | None = None, nargs: str | None = None,
        check: Within | OneOf | None = None) -> T:
    """A dataclass field with its ``Option``; a list default is copied for each instance."""
    metadata = {"option": Option(flags, off, metavar, nargs, check)}
    if isinstance(default, list):
        items = list(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option(field: dataclasses.Field) -> Option | None:
    """The field's ``Option``; None for a field not declared with ``opt`` (a config section)."""
    return field.metadata.get("option")
