"""Tiny random targets of each family the target pass supports (hybrid, MoE), saved with save_pretrained."""

from __future__ import annotations

import pytest

from helpers import make_qwen3_5_moe_target, make_qwen3_5_target, make_qwen3_5_vl_target, make_qwen3_moe_target


@pytest.fixture(scope="session")
def qwen3_5_target(tmp_path_factory):
    return make_qwen3_5_target(tmp_path_factory.mktemp("qwen3_5_target"))


@pytest.fixture(scope="session")
def qwen3_5_moe_target(tmp_path_factory):
    return make_qwen3_5_moe_target(tmp_path_factory.mktemp("qwen3_5_moe_target"))


@pytest.fixture(scope="session")
def qwen3_moe_target(tmp_path_factory):
    return make_qwen3_moe_target(tmp_path_factory.mktemp("qwen3_moe_target"))


@pytest.fixture(scope="session")
def qwen3_5_vl_target(tmp_path_factory):
    return make_qwen3_5_vl_target(tmp_path_factory.mktemp("qwen3_5_vl_target"))
