"""Find the drafter inside a run directory, a training checkpoint or a drafter directory."""

from __future__ import annotations

from pathlib import Path

from draftline import run_files
from draftline.checkpoint.export import is_drafter_dir
from draftline.checkpoint.state import verify_checkpoint
from draftline.checkpoint.writer import DRAFTER_DIR
from draftline.errors import DraftlineError


def find_drafter_dir(path: str | Path) -> Path:
    """The export-format directory behind ``path``.

    Accepts a drafter directory itself, a training checkpoint (``.../step-N`` holding ``drafter/``),
    or a run directory (its ``final/`` if present, else its latest checkpoint).
    """
    path = Path(path)
    if not path.exists():
        raise DraftlineError(f"{path}: no such directory")
    if is_drafter_dir(path):
        return path
    if is_drafter_dir(path / DRAFTER_DIR):
        return path / DRAFTER_DIR
    if is_drafter_dir(path / run_files.FINAL):
        return path / run_files.FINAL
    folder = path / run_files.CHECKPOINTS
    checkpoints = sorted(folder.glob("step-*")) if folder.is_dir() else []
    for ckpt in reversed(checkpoints):  # the newest whole one: a cut or corrupt checkpoint is passed over
        if is_drafter_dir(ckpt / DRAFTER_DIR) and verify_checkpoint(ckpt, drafter_only=True) is None:
            return ckpt / DRAFTER_DIR
    raise DraftlineError(
        f"{path}: no drafter found (looked for config.json + model.safetensors in it, in drafter/, in final/ "
        "and in checkpoints/step-*/drafter/)"
    )
