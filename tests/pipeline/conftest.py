"""Fixtures for the training line: a small prepared dataset with learnable text."""

from __future__ import annotations

import pytest

from line_helpers import write_dataset


@pytest.fixture(scope="session")
def line_data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("line_data") / "data")
