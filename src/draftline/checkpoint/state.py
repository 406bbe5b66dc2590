"""Training checkpoints: everything needed to continue a run exactly, on any number of drafters.

``RUN_DIR/checkpoints/step-00000120/`` holds
- ``drafter/``: the drafter in the export format, fp32 (servers and ``draftline eval`` load it as it
  is; ``draftline export`` writes a bf16 copy),
- ``state/``: the drafter's weights and AdamW state as ``torch.distributed.checkpoint`` writes them,
  each drafter rank its own shards; DCP loads them on any number of drafters (it reshards),
- ``trainer.pt``: the scheduler, RNG states and counters, the resolved config; ``trainer.json``: the
  step, the data position (the next batch number; batches in flight are recomputed after a resume) and
  the batches per optimizer step, readable without torch,
- ``manifest.json``, written last: every file's size and SHA-256. A checkpoint without it, or whose
  files do not match it (a truncated copy, a bad disk), is skipped on resume for the previous one.

Every drafter rank calls ``save_checkpoint`` at the same step. Saving stalls training for a copy to
host memory only:

    training thread (every drafter): wait for the previous write (its error is raised here) -> stage
        the drafter's and the optimizer's state (this rank's shards) to host memory and start DCP's
        write in the background -> the first drafter also gathers the whole fp32 weights (for
        ``drafter/``) and copies the trainer state -> return
    writer thread (the first drafter): DCP's write done on every rank (its metadata is written last)
        -> ``drafter/``, ``trainer.pt``/``.json`` (fsync) -> manifest (fsync) -> rename ``.tmp-step-N``
        to ``step-N`` -> ``latest`` replaced atomically -> prune to the last ``keep``

The writer thread's part is ``writer``. With several drafter ranks the run directory must be on a file
system every rank sees (one node's disk, or a shared one across nodes). ``writer.wait_for_checkpoint()``
blocks until the write in flight is on disk and raises its error. A failed write (a full disk) leaves the
previous checkpoints and ``latest`` as they were, and says what the disk lacks.

The drafters' group is passed in (``distributed.shard.DrafterGroup``: who is first, the barriers, the
gathers of sharded weights); without one, the drafter is alone in its process (``OneDrafter``).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from draftline import run_files
from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME, drafter_config_dict, load_drafter
from draftline.checkpoint.writer import (
    DRAFTER_DIR, MANIFEST, STATE_DIR, TRAINER_JSON, TRAINER_STATE, WRITER, PendingWrite, checkpoint_bytes, checkpoint_dir,
    sha256,
)
from draftline.errors import DraftlineError

FORMAT = 2
"""1: optimizer state inside trainer.pt (one drafter); 2: ``state/`` written by torch.distributed.checkpoint."""

# One process saves and loads with ``no_dist``; DCP still warns (in its writer thread too) that it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
    batches_per_step: int | None = None
    """Batches per optimizer step of the run (a resume keeps it, whatever its number of drafters)."""
    num_drafters: int = 1
    format: int = field(default=FORMAT)

    def summary(self) -> dict[str, Any]:
        """What ``trainer.json`` holds: the step and the data position, without the config."""
        return {k: v for k, v in asdict(self).items() if k != "config"}


def read_trainer_state(path: str | Path) -> TrainerState:
    """A checkpoint's step, data position and batches per step, from ``trainer.json`` (or, for a checkpoint
    written before it, from ``trainer.pt``)."""
    path = Path(path)
    summary = path / TRAINER_JSON
    if summary.is_file():
        data = json.loads(summary.read_text())
        config = {}
        if (path / TRAINER_STATE).is_file():
            config = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False).get("config", {})
        return TrainerState(**{**data, "config": config})
    payload = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    step = payload["step"]
    return TrainerState(step, payload["next_seq"], payload["in_flight"], payload["counters"], payload["config"],
                        batches_per_step=payload["next_seq"] // step if step else None, format=1)


def _staged_state(drafter, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(drafter, optimizer)
    return {"model": model_state, "optim": optim_state}


class OneDrafter:
    """The drafters' group of a drafter alone in its process: what ``save_checkpoint`` and ``load_checkpoint``
    assume when they are given no group (the interface of ``distributed.shard.DrafterGroup``)."""

    num_drafters = 1
    is_first = True
    sharded = False
    checkpoint_group = None

    def barrier(self) -> None:
        pass

    def full_weights(self, drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
        return whole_weights(drafter)


def whole_weights(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A drafter's weights held whole on this rank, as fp32 copies on the host."""
    return {name: t.detach().to("cpu", torch.float32, copy=True) for name, t in drafter.state_dict().items()}


def save_checkpoint(
    run_dir: str | Path,
    *,
    drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    keep: int,
    group=None,
    wait: bool = False,
) -> Path:
    """Checkpoint ``state.step``: stage the state to host memory now, write it in the background.

    Every drafter rank calls this at the same step (``group``: ``distributed.shard.DrafterGroup``; None: one
    drafter in one process). Waits first for the previous write (and raises its error, a ``DraftlineError``).
    Returns the directory the checkpoint will have; ``wait=True`` (or ``wait_for_checkpoint()``) returns
    once it is on disk. A save made while an exception is being handled (a failure's last checkpoint)
    waits too: the process may end with ``os._exit`` right after, which would cut a background write.
    """
    import torch.distributed.checkpoint as dcp

    group = group or OneDrafter()
    WRITER.wait()
    run_dir = Path(run_dir)
    target = checkpoint_dir(run_dir, state.step)
    tmp = target.with_name(f".tmp-{target.name}")
    if group.is_first:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a write cut short
        (tmp / STATE_DIR).mkdir(parents=True)
    group.barrier()  # the folder exists (and is empty) before any rank writes into it
    staged = _staged_state(drafter, optimizer)
    distributed = dist.is_available() and dist.is_initialized()
    upload = dcp.async_save(staged, checkpoint_id=str(tmp / STATE_DIR),
                            process_group=group.checkpoint_group if distributed else None, no_dist=not distributed)
    weights = group.full_weights(drafter)  # gathered: every drafter takes part
    pending = PendingWrite(state.step, target, tmp, upload, group.is_first, keep=keep)
    if group.is_first:
        state = replace(state, num_drafters=group.num_drafters)
        pending = replace(
            pending, weights={name: t.contiguous() for name, t in weights.items()},
            drafter_config=drafter_config_dict(_unwrapped(drafter).config, torch.float32),
            payload={"format": FORMAT, "step": state.step, "next_seq": state.next_seq,
                     "in_flight": list(state.in_flight), "counters": copy.deepcopy(state.counters),
                     "config": copy.deepcopy(state.config), "scheduler": _to_cpu(scheduler.state_dict()),
                     "rng": rng_state()},
            summary=state.summary(), size_hint=checkpoint_bytes(sum(t.numel() for t in weights.values())))
    path = WRITER.start(pending)
    if wait or sys.exc_info()[0] is not None:
        WRITER.wait()
    return path


def _unwrapped(drafter):
    return getattr(drafter, "_orig_mod", drafter)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


# ------------------------------------------------------------------------------------------ finding one
_VERIFIED: set[tuple[str, float, bool]] = set()  # (checkpoint, manifest mtime) already checked in this process


def verify_checkpoint(path: str | Path, *, drafter_only: bool = False) -> str | None:
    """Why ``path`` is not a whole checkpoint (a missing file, a size or checksum that differs from
    its manifest), or None if it is. A checkpoint from before manifests counts if its files exist.
    ``drafter_only``: only its ``drafter/`` matters (eval and export)."""
    path = Path(path)
    if not drafter_only and not (path / TRAINER_STATE).is_file():
        return f"no {TRAINER_STATE}"
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        legacy = (path / DRAFTER_DIR / WEIGHTS_NAME).is_file() and (path / DRAFTER_DIR / CONFIG_NAME).is_file()
        return None if legacy else f"no {MANIFEST} and no drafter/{WEIGHTS_NAME}"
    key = (str(path.resolve()), manifest_file.stat().st_mtime, drafter_only)
    if key in _VERIFIED:
        return None
    try:
        files = json.loads(manifest_file.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, expected in files.items():
        if drafter_only and not name.startswith("drafter/"):
            continue
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size:,} bytes, the manifest says {expected['size']:,} (truncated?)"
        if sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum (corrupt)"
    _VERIFIED.add(key)
    return None


def latest_checkpoint(run_dir: str | Path, *, quiet: bool = False) -> Path | None:
    """The newest whole checkpoint of ``run_dir`` (``latest`` first, then by step).

    A newer checkpoint that is truncated or corrupt is moved aside to ``corrupt-step-N`` (kept for a
    look, out of resume's and pruning's way) with a message naming it and why.
    """
    WRITER.wait()  # a write of this process in flight is part of the answer
    folder = Path(run_dir) / run_files.CHECKPOINTS
    if not folder.is_dir():
        return None
    candidates = sorted((p for p in folder.glob("step-*") if p.is_dir()), reverse=True)
    pointer = folder / run_files.LATEST
    if pointer.is_file():
        named = folder / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for candidate in candidates:
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate
        aside = candidate.with_name(f"corrupt-{candidate.name}")
        try:
            os.replace(candidate, aside)
            moved = f"moved to {aside.name}"
        except OSError:
            moved = "left in place"
        if not quiet:
            print(f"draftline: checkpoint {candidate} is not whole ({problem}); skipped it ({moved}) and use the one "
                  "before it", file=sys.stderr, flush=True)
    return None


# ------------------------------------------------------------------------------------------ loading
def load_checkpoint(
    path: str | Path,
    *,
    drafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    restore_rng: bool = True,
    group=None,
    verify: bool = True,
) -> TrainerState:
    """Load a checkpoint into existing objects (weights and fp32 optimizer state in place), whatever the
    number of drafters that wrote it and that load it (every drafter rank calls this). ``verify``: check its
    files against its manifest first (the first drafter already did, when it chose the checkpoint). Returns
    its trainer state, whose counters carry the schedule's clock (``clock``) also for a checkpoint written
    before they did."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    group = group or OneDrafter()
    WRITER.wait()
    if not (path / TRAINER_STATE).is_file():
        raise DraftlineError(f"{path}: not a training checkpoint (no {TRAINER_STATE})")
    problem = verify_checkpoint(path) if verify else None
    if problem:
        raise DraftlineError(f"{path}: checkpoint is not whole ({problem}); resume from an earlier one "
                             "(delete or move this one: --resume then takes the newest whole checkpoint)")
    try:
        payload = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
        if (path / STATE_DIR).is_dir():
            staged = _staged_state(drafter, optimizer)
            distributed = dist.is_available() and dist.is_initialized()
            dcp.load(staged, checkpoint_id=str(path / STATE_DIR),
                     process_group=group.checkpoint_group if distributed else None, no_dist=not distributed)
            set_state_dict(drafter, optimizer, model_state_dict=staged["model"], optim_state_dict=staged["optim"])
        else:
            _load_format_1(path, payload, drafter, optimizer, group)
    except DraftlineError:
        raise
    except Exception as exc:  # noqa: BLE001 - a cut or foreign checkpoint
        raise DraftlineError(f"{path}: checkpoint cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                             "move it aside and resume from the one before") from None
    scheduler.load_state_dict(payload["scheduler"])
    if restore_rng:
        set_rng_state(payload["rng"])
    state = read_trainer_state(path)
    if "clock" in payload["scheduler"]:  # written when the schedule held its clock (--max-minutes), not the progress
        state.counters.setdefault("clock", float(payload["scheduler"]["clock"]))
    return state


def _load_format_1(path: Path, payload: dict, drafter, optimizer, group) -> None:
    """A checkpoint from before ``state/``: the optimizer state in trainer.pt, for one drafter."""
    if group.sharded:
        raise DraftlineError(f"{path}: written by an earlier draftline with the optimizer state in trainer.pt, which "
                             "loads on one drafter only; resume it on one drafter, save, then resume on more")
    device = next(drafter.parameters()).device
    saved = load_drafter(path / DRAFTER_DIR, device=device, dtype=torch.float32)
    with torch.no_grad():
        for (_, param), (_, value) in zip(drafter.state_dict().items(), saved.state_dict().items()):
            param.copy_(value)
    optimizer.load_state_dict(payload["optimizer"])


