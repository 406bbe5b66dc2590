"""The config's field docstrings are read from its source: every field has one."""

from __future__ import annotations

import dataclasses

import pytest

from draftline.config import TrainConfig
from draftline.config_docs import field_docs, section_doc

SECTIONS = [type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)
            if dataclasses.is_dataclass(getattr(TrainConfig(), f.name))]


@dataclasses.dataclass
class _Example:
    """An example section."""

    documented: int = 1
    """Over two lines,
    joined into one."""
    bare: int = 2
    after_bare: str = "x"
    """Its own words."""


def test_docstrings_are_read_from_the_source_one_line_each():
    assert field_docs(_Example) == {"documented": "Over two lines, joined into one.", "after_bare": "Its own words."}
    assert section_doc(_Example) == "An example section."


def test_a_class_without_a_docstring_has_none_not_its_dataclass_signature():
    @dataclasses.dataclass
    class Bare:
        x: int = 0

    assert Bare.__doc__  # dataclass writes the signature there
    assert section_doc(Bare) == ""


@pytest.mark.parametrize("section", [TrainConfig, *SECTIONS], ids=lambda c: c.__name__)
def test_every_config_field_and_section_has_a_docstring(section):
    docs = field_docs(section)
    names = [f.name for f in dataclasses.fields(section) if not dataclasses.is_dataclass(getattr(section(), f.name))]
    missing = [name for name in names if len(docs.get(name, "").split()) < 4]
    assert not missing, f"{section.__name__}: fields without a docstring of a few words: {missing}"
    assert section_doc(section), f"{section.__name__} has no class docstring"
