"""Shared fixtures: tiny random targets built from a config and saved with save_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


from helpers import make_llama_target, make_qwen3_target  # noqa: E402
from line_helpers import write_dataset  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory):
    return make_qwen3_target(tmp_path_factory.mktemp("qwen3_target"))


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory):
    return make_llama_target(tmp_path_factory.mktemp("llama_target"))


@pytest.fixture(scope="session")
def line_data(tmp_path_factory):
    """A small prepared dataset with learnable text, for runs of the training line."""
    return write_dataset(tmp_path_factory.mktemp("line_data") / "data")


GPU_TEST_LIMIT_S = 300
"""The hard limit of a GPU test that names none: a cold machine's first compiles included. pytest-timeout's
thread method: a test stuck in a CUDA call or a collective cannot ignore it; it prints every thread's stack
and ends the session (a hang is named, not waited for)."""


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(GPU_TEST_LIMIT_S, method="thread"))
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
