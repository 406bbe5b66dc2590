"""Training checkpoints: everything needed to continue a run exactly.

``RUN_DIR/checkpoints/step-00000120/`` holds
- ``drafter/``: the drafter in the export format, fp32 (servers load it as it is; ``draftline
  export`` writes a bf16 copy),
- ``trainer.pt``: optimizer and scheduler state in full precision, RNG states, the data position
  (the next batch number; the batches that were in flight are recomputed after a resume), the step
  and counters, and the resolved config,
- ``manifest.json``, written last: every file's size and SHA-256. A checkpoint without it, or whose
  files do not match it (a truncated copy, a bad disk), is skipped on resume for the previous one.

Saving does not stall training longer than a copy to host memory:

    training thread:  save_checkpoint -> wait for the previous write (at most one in flight; its
                      error, if any, is raised here) -> copy weights, optimizer state and RNG to CPU
                      -> return
    writer thread:    files into .tmp-step-N/ (fsync) -> manifest.json (fsync) -> rename to step-N
                      -> ``latest`` replaced atomically -> prune to the last ``keep``

``wait_for_checkpoint()`` blocks until the write in flight is on disk and raises its error; the
training loop calls it after its final (or SIGTERM) save and before the process exits (a normal exit
waits for the writer thread anyway; ``os._exit`` would not). A save during exception handling is
written before it returns. A failed write (a full disk) leaves the previous checkpoints and ``latest``
as they were.
"""

from __future__ import annotations

import atexit
import copy
import errno
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME, drafter_config_dict, load_drafter
from draftline.errors import DraftlineError
from draftline.model.drafter import DFlashDrafter

TRAINER_STATE = "trainer.pt"
MANIFEST = "manifest.json"


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


def _to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor copied to host memory (the live state keeps changing)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.deepcopy(value)


@dataclass
class _Snapshot:
    step: int
    weights: dict[str, torch.Tensor]  # fp32, CPU
    drafter_config: dict
    payload: dict  # trainer.pt


def _snapshot(drafter: DFlashDrafter, optimizer, scheduler, state: TrainerState) -> _Snapshot:
    # The only part of a save on the training thread: device -> host copies (they sync with the GPU).
    weights = {name: t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
               for name, t in drafter.state_dict().items()}
    payload = {
        "format": 1,
        "step": state.step,
        "next_seq": state.next_seq,
        "in_flight": list(state.in_flight),
        "counters": copy.deepcopy(state.counters),
        "config": copy.deepcopy(state.config),
        "optimizer": _to_cpu(optimizer.state_dict()),
        "scheduler": _to_cpu(scheduler.state_dict()),
        "rng": rng_state(),
    }
    return _Snapshot(state.step, weights, drafter_config_dict(drafter.config, torch.float32), payload)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _write(snapshot: _Snapshot, run_dir: Path, keep: int) -> Path:
    """Write a snapshot as ``step-N`` (temp dir, fsync, manifest last, rename); prune to ``keep``."""
    final = checkpoint_dir(run_dir, snapshot.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        (tmp / "drafter").mkdir()
        save_file(snapshot.weights, str(tmp / "drafter" / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "drafter" / CONFIG_NAME).write_text(json.dumps(snapshot.drafter_config, indent=2) + "\n")
        torch.save(snapshot.payload, tmp / TRAINER_STATE)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": snapshot.step, "files": files}, indent=2) + "\n")
        _fsync(manifest)
        _fsync(tmp / "drafter")
        _fsync(tmp)
        old = None
        if final.exists():  # the same step saved again (a stop right after a periodic save)
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _write_atomic(final.parent / "latest", final.name + "\n")
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(final.parent, keep)
    return final


class _Writer:
    """One background write at a time; its error is kept until the training thread asks."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.target: Path | None = None
        self.previous: Path | None = None  # the last checkpoint written whole

    def start(self, snapshot: _Snapshot, run_dir: Path, keep: int) -> Path:
        self.target = checkpoint_dir(run_dir, snapshot.step)

        def work():
            try:
                self.previous = _write(snapshot, run_dir, keep)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self.error = exc

        # Not a daemon: a normal interpreter exit waits for the write rather than cutting it.
        self.thread = threading.Thread(target=work, name=f"checkpoint-{snapshot.step}", daemon=False)
        self.thread.start()
        return self.target

    def wait(self) -> Path | None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            exc, self.error = self.error, None
            previous = self.previous
            pointer = self.target.parent / "latest" if self.target else None
            if previous is None and pointer is not None and pointer.is_file():
                previous = pointer.parent / pointer.read_text().strip()
            raise _write_error(exc, self.target, previous) from exc
        return self.previous


def _write_error(exc: BaseException, target: Path | None, previous: Path | None) -> DraftlineError:
    kept = (f"the previous checkpoint {previous} is whole" if previous else
            "the checkpoints written before are untouched")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = f"the disk is full ({os.strerror(exc.errno)})"
        fix = f"free space on {target.parent if target else 'the run directory'}'s disk (or lower --keep) and resume with --resume"
    else:
        cause = f"{type(exc).__name__}: {exc}"
        fix = "fix the cause and resume with --resume"
    return DraftlineError(f"could not write checkpoint {target}: {cause}; nothing of it was kept and {kept}; {fix}")


_WRITER = _Writer()


def save_checkpoint(
    run_dir: str | Path,
    *,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    keep: int,
    wait: bool = False,
) -> Path:
    """Checkpoint ``state.step``: copy the state to host memory now, write it in the background.

    Waits first for the previous write (and raises its error, a ``DraftlineError``). Returns the
    directory the checkpoint will have; ``wait=True`` (or ``wait_for_checkpoint()``) returns once it is
    on disk. A save made while an exception is being handled (a failure's last checkpoint) waits too:
    the process may end with ``os._exit`` right after, which would cut a background write.
    """
    _WRITER.wait()
    snapshot = _snapshot(drafter, optimizer, scheduler, state)
    path = _WRITER.start(snapshot, Path(run_dir), keep)
    if wait or sys.exc_info()[0] is not None:
        _WRITER.wait()
    return path


def wait_for_checkpoint() -> Path | None:
    """Block until the checkpoint being written is on disk; raise its error (``DraftlineError``,
    naming the checkpoint, the cause and the fix). Returns the last checkpoint written whole."""
    return _WRITER.wait()


@atexit.register
def _report_at_exit() -> None:
    try:
        _WRITER.wait()
    except DraftlineError as exc:  # never lost: the training loop should have called wait_for_checkpoint
        print(f"draftline: error: {exc}", file=sys.stderr, flush=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(folder: Path, keep: int) -> None:
    checkpoints = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in checkpoints[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(".tmp-step-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)


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
        legacy = (path / "drafter" / WEIGHTS_NAME).is_file() and (path / "drafter" / CONFIG_NAME).is_file()
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
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum (corrupt)"
    _VERIFIED.add(key)
    return None


def latest_checkpoint(run_dir: str | Path, *, quiet: bool = False) -> Path | None:
    """The newest whole checkpoint of ``run_dir`` (``latest`` first, then by step).

    A newer checkpoint that is truncated or corrupt is moved aside to ``corrupt-step-N`` (kept for a
    look, out of resume's and pruning's way) with a message naming it and why.
    """
    _WRITER.wait()  # a write of this process in flight is part of the answer
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return None
    candidates = sorted((p for p in folder.glob("step-*") if p.is_dir()), reverse=True)
    pointer = folder / "latest"
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


def load_checkpoint(
    path: str | Path,
    *,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    restore_rng: bool = True,
) -> TrainerState:
    """Load a checkpoint into existing objects (weights copied in place, fp32 optimizer state),
    after checking its files against its manifest."""
    path = Path(path)
    _WRITER.wait()
    if not (path / TRAINER_STATE).is_file():
        raise DraftlineError(f"{path}: not a training checkpoint (no {TRAINER_STATE})")
    problem = verify_checkpoint(path)
    if problem:
        raise DraftlineError(f"{path}: checkpoint is not whole ({problem}); resume from an earlier one "
                             "(delete or move this one: --resume then takes the newest whole checkpoint)")
    device = next(drafter.parameters()).device
    try:
        saved = load_drafter(path / "drafter", device=device, dtype=torch.float32)
        payload = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    except DraftlineError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint from before manifests can be cut too
        raise DraftlineError(f"{path}: checkpoint cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                             "move it aside and resume from the one before") from None
    with torch.no_grad():
        for (name, param), (_, value) in zip(drafter.state_dict().items(), saved.state_dict().items()):
            param.copy_(value)
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
