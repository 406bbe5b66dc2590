"""The training line in tests: a learnable dataset, small-run arguments, the CLI in a subprocess, what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from draftline.data.dataset import DatasetWriter

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftline", "train", *args], env=ENV if env is None else env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftline", "train", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@contextmanager
def one_thread():
    """torch on one thread in this process, as on each rank of a launched run (OMP_NUM_THREADS=1 in ENV): a run
    in this process saves a process's imports (~4 s) and computes as a rank does."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from trace/steps.jsonl (a later record for the same step wins: it was re-run after a resume)."""
    return {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "trace" / "steps.jsonl")}


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended (code {proc.returncode}) before {what}:\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def write_dataset(path, *, vocab_size=320, num_docs=48, seed=0, min_len=24, max_len=120, alphabet=40):
    """Documents of counting sequences (x_{i+1} = x_i + step mod ``alphabet``): a drafter can learn them."""
    rng = np.random.default_rng(seed)
    writer = DatasetWriter(path, vocab_size)
    for _ in range(num_docs):
        length = int(rng.integers(min_len, max_len))
        start, step = int(rng.integers(0, alphabet)), int(rng.integers(1, 3))
        ids = (start + step * np.arange(length)) % alphabet
        prompt = int(rng.integers(2, length // 3))
        mask = np.arange(length) >= prompt
        writer.add(ids, mask, [length])
    writer.finish({"target_vocab_size": vocab_size, "source": "tests"})
    return path


def base_args(target, data, out, **extra):
    """Command-line arguments of a small CPU run."""
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--draft-layers", "1", "--block-size", "4", "--max-anchors", "8", "--token-budget", "512",
            "--max-batch-size", "8", "--epochs", "1", "--lr", "3e-3", "--warmup-ratio", "0", "--log-every", "0.5",
            "--no-tensorboard", "--save-every", "3"]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return args


def resume_copy(checkpoint: Path, out: Path) -> None:
    """A run directory holding only ``checkpoint``: what a run stopped right after it leaves to --resume."""
    import shutil

    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)
    (out / "checkpoints" / "latest").write_text(checkpoint.name + "\n")
