"""The tiny qwen3 target, loaded (the methods' decoding runs on it)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def qwen3_model(qwen3_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
