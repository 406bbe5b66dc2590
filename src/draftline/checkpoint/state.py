"""Training checkpoints: everything needed to continue a run exactly.

``RUN_DIR/checkpoints/step-00000120/`` holds
- ``drafter/``: the drafter in the export format, fp32 (servers load it as it is; ``draftline
  export`` writes a bf16 copy),
- ``trainer.pt``: optimizer and scheduler state in full precision, RNG states, the data position
  (the next batch number; the batches that were in flight are recomputed after a resume), the step
  and counters, and the resolved config.

A checkpoint is written into a temporary directory and renamed into place, then ``latest`` (a
one-line file) is replaced atomically; only the last ``keep`` checkpoints stay.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.errors import DraftlineError
from draftline.model.drafter import DFlashDrafter

TRAINER_STATE = "trainer.pt"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainerState:
    step: int
    next_seq: int
    in_flight: list[int]
    counters: dict[str, Any]
    config: dict[str, Any]


def save_checkpoint(
    run_dir: str | Path,
    *,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    keep: int,
) -> Path:
    """Write a checkpoint for ``state.step`` atomically; prune to the last ``keep``."""
    run_dir = Path(run_dir)
    final = checkpoint_dir(run_dir, state.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
        payload = {
            "format": 1,
            "step": state.step,
            "next_seq": state.next_seq,
            "in_flight": state.in_flight,
            "counters": state.counters,
            "config": state.config,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(payload, tmp / TRAINER_STATE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(final.parent / "latest", final.name + "\n")
    _prune(final.parent, keep)
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(folder: Path, keep: int) -> None:
    checkpoints = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in checkpoints[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(".tmp-step-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    folder = Path(run_dir) / "checkpoints"
    pointer = folder / "latest"
    if pointer.is_file():
        candidate = folder / pointer.read_text().strip()
        if (candidate / TRAINER_STATE).is_file():
            return candidate
    complete = [p for p in sorted(folder.glob("step-*")) if (p / TRAINER_STATE).is_file()]
    return complete[-1] if complete else None


def load_checkpoint(
    path: str | Path,
    *,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    restore_rng: bool = True,
) -> TrainerState:
    """Load a checkpoint into existing objects (weights copied in place, fp32 optimizer state)."""
    path = Path(path)
    if not (path / TRAINER_STATE).is_file():
        raise DraftlineError(f"{path}: not a training checkpoint (no {TRAINER_STATE})")
    device = next(drafter.parameters()).device
    saved = load_drafter(path / "drafter", device=device, dtype=torch.float32)
    with torch.no_grad():
        for (name, param), (_, value) in zip(drafter.state_dict().items(), saved.state_dict().items()):
            param.copy_(value)
    payload = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    if restore_rng:
        set_rng_state(payload["rng"])
    return TrainerState(payload["step"], payload["next_seq"], payload["in_flight"], payload["counters"], payload["config"])


def record_start(run_dir: str | Path, entry: dict[str, Any]) -> None:
    """Append this start (fresh or resume, from which step) to RUN_DIR/starts.jsonl."""
    path = Path(run_dir) / "starts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
