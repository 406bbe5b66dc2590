"""Find the drafter inside a run directory, a training checkpoint or a drafter directory."""

from __future__ import annotations

from pathlib import Path

from draftline.checkpoint.export import is_drafter_dir
from draftline.checkpoint.state import verify_checkpoint
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
    if is_drafter_dir(path / "drafter"):
        return path / "drafter"
    if is_drafter_dir(path / "final"):
        return path / "final"
    checkpoints = sorted((path / "checkpoints").glob("step-*")) if (path / "checkpoints").is_dir() else []
    for ckpt in reversed(checkpoints):  # the newest whole one: a cut or corrupt checkpoint is passed over
        if is_drafter_dir(ckpt / "drafter") and verify_checkpoint(ckpt, drafter_only=True) is None:
            return ckpt / "drafter"
    raise DraftlineError(
        f"{path}: no drafter found (looked for config.json + model.safetensors in it, in drafter/, in final/ "
        "and in checkpoints/step-*/drafter/)"
    )
