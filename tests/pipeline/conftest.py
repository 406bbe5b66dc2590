"""Fixtures for the training line: a tiny target and a small prepared dataset with learnable text."""

from __future__ import annotations

import numpy as np
import pytest

from draftline.data.dataset import DatasetWriter


def write_dataset(path, *, vocab_size=320, num_docs=48, seed=0, min_len=24, max_len=120):
    """Documents of counting sequences (x_{i+1} = x_i + step mod V): a drafter can learn them."""
    rng = np.random.default_rng(seed)
    writer = DatasetWriter(path, vocab_size)
    for _ in range(num_docs):
        length = int(rng.integers(min_len, max_len))
        start, step = int(rng.integers(0, vocab_size)), int(rng.integers(1, 4))
        ids = (start + step * np.arange(length)) % (vocab_size - 1)
        prompt = int(rng.integers(2, length // 3))
        mask = np.arange(length) >= prompt
        writer.add(ids, mask, [length])
    writer.finish({"target_vocab_size": vocab_size, "source": "tests"})
    return path


@pytest.fixture(scope="session")
def line_data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("line_data") / "data")


def base_args(target, data, out, **extra):
    """Command-line arguments of a small CPU run."""
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--draft-layers", "1", "--block-size", "4", "--max-anchors", "8", "--token-budget", "512",
            "--max-batch-size", "8", "--epochs", "1", "--lr", "3e-3", "--warmup-ratio", "0", "--log-every", "0.5",
            "--no-tensorboard", "--save-every", "3"]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return args
