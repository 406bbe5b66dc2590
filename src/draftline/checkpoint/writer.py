"""Writing a training checkpoint's files in the background, one write in flight, its error never lost.

The training thread stages the state in host memory and hands it here (``state.save_checkpoint``); a writer
thread of the first drafter then waits for torch.distributed.checkpoint's write of ``state/`` on every rank,
writes ``drafter/``, ``trainer.pt`` and ``trainer.json`` (fsync), the manifest of every file's size and
SHA-256 (fsync, last), renames ``.tmp-step-N`` to ``step-N``, replaces ``latest`` atomically and prunes to the
last ``keep``. The next save, ``wait_for_checkpoint`` and the interpreter's exit wait for it; its error is
raised there: a full disk as a ``MachineError`` that says what the disk lacks, anything else (a peer that
died mid-write) as a ``CheckpointWriteError``. A failed write leaves the checkpoints before it untouched.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftline import run_files
from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME
from draftline.errors import DraftlineError, MachineError
from draftline.files import os_error_of

DRAFTER_DIR = "drafter"
TRAINER_STATE = "trainer.pt"
TRAINER_JSON = "trainer.json"
STATE_DIR = "state"
MANIFEST = "manifest.json"

def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / run_files.CHECKPOINTS / f"step-{step:08d}"


@dataclass
class PendingWrite:
    """A save in flight on this rank: what the training thread staged, handed over whole."""

    step: int
    target: Path
    tmp: Path
    upload: Any  # DCP's future
    first: bool  # this rank writes drafter/, the trainer state and the manifest, and renames
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    drafter_config: dict | None = None
    payload: dict | None = None
    summary: dict | None = None
    keep: int = 1
    size_hint: int = 0  # bytes this checkpoint takes, for a full disk's message


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finish(pending: PendingWrite) -> Path:
    """The first drafter's part once DCP's write is done everywhere: the rest of the files, manifest, rename."""
    pending.upload.result()
    if not pending.first:
        return pending.target
    tmp, final = pending.tmp, pending.target
    try:
        (tmp / DRAFTER_DIR).mkdir(exist_ok=True)
        save_file(pending.weights, str(tmp / DRAFTER_DIR / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / DRAFTER_DIR / CONFIG_NAME).write_text(json.dumps(pending.drafter_config, indent=2) + "\n")
        torch.save(pending.payload, tmp / TRAINER_STATE)
        (tmp / TRAINER_JSON).write_text(json.dumps(pending.summary, indent=2) + "\n")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": sha256(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": pending.step, "files": files}, indent=2) + "\n")
        _fsync(manifest)
        for folder in (tmp / DRAFTER_DIR, tmp / STATE_DIR, tmp):
            _fsync(folder)
        old = None
        if final.exists():  # the same step saved again (a stop right after a periodic save)
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _write_atomic(final.parent / run_files.LATEST, final.name + "\n")
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(final.parent, pending.keep)
    return final


class _Writer:
    """One save in flight at a time; its error is kept until the training thread asks."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.pending: PendingWrite | None = None
        self.previous: Path | None = None  # the last checkpoint written whole

    def start(self, pending: PendingWrite) -> Path:
        self.pending = pending

        def work():
            try:
                self.previous = _finish(pending)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self.error = exc
                if pending.first:
                    shutil.rmtree(pending.tmp, ignore_errors=True)

        # Not a daemon: a normal interpreter exit waits for the write rather than cutting it.
        self.thread = threading.Thread(target=work, name=f"checkpoint-{pending.step}", daemon=False)
        self.thread.start()
        return pending.target

    def wait(self) -> Path | None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            exc, self.error = self.error, None
            pending = self.pending
            previous = self.previous
            pointer = pending.target.parent / run_files.LATEST if pending else None
            if previous is None and pointer is not None and pointer.is_file():
                previous = pointer.parent / pointer.read_text().strip()
            raise _write_error(exc, pending, previous) from None
        return self.previous


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (DCP wraps its ranks' errors in a CheckpointException)."""
    seen = 0
    while exc is not None and seen < 12:
        if os_error_of(exc) is not None:  # an OSError, or safetensors' error around one
            return os_error_of(exc)
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for inner in failures.values():  # rank -> the exception (and its traceback)
                found = _os_error(inner[0] if isinstance(inner, tuple) else inner)
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class CheckpointWriteError(RuntimeError):
    """A checkpoint's write failed for a reason other than the machine's storage: a collective save whose
    peer died mid-write (the usual case), or a bug. A failure of the run, whose culprit the failure
    handler looks for, not an error of the user's (that is a ``MachineError``: a full disk, a permission)."""


def _write_error(exc: BaseException, pending: PendingWrite | None, previous: Path | None
                 ) -> MachineError | CheckpointWriteError:
    target = pending.target if pending else None
    kept = (f"the previous checkpoint {previous} is whole and --resume continues from it" if previous else
            "the checkpoints written before are untouched")
    os_error = _os_error(exc)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = target.parent if target else Path(".")
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        size = f", and a checkpoint takes about {_bytes(pending.size_hint)}" if pending and pending.size_hint else ""
        cause = f"the disk is full ({os.strerror(os_error.errno)}): {_bytes(free)} free on {folder}{size}"
        fix = "free space there (or lower --keep, or move --out to a larger disk) and run the same command with --resume"
    elif os_error is not None:
        cause = f"{type(os_error).__name__}: {str(os_error)[:300]}"
        fix = "fix the cause and run the same command with --resume"
    else:
        return CheckpointWriteError(f"could not write checkpoint {target}: {type(exc).__name__}: "
                                    f"{str(exc)[:300]}; nothing of it was kept and {kept}")
    return MachineError(f"could not write checkpoint {target}: {cause}; nothing of it was kept and {kept}; {fix}")


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


WRITER = _Writer()
"""This process's writer (one save in flight)."""


def checkpoint_bytes(num_trained_params: int, *, legacy: bool = False) -> int:
    """About how many bytes a checkpoint takes: fp32 weights twice (``drafter/`` and ``state/``) and the two
    fp32 AdamW moments: 16 bytes per trained weight."""
    return 16 * num_trained_params


def wait_for_checkpoint() -> Path | None:
    """Block until the checkpoint being written is on disk; raise its error (``DraftlineError``,
    naming the checkpoint, the cause and the fix). Returns the last checkpoint written whole."""
    return WRITER.wait()


def settle_checkpoint_write() -> Exception | None:
    """Block until the checkpoint being written is on disk or failed; its error returned, not raised (a
    failing run's handler: the write is then usually part of the failure)."""
    try:
        WRITER.wait()
    except (DraftlineError, CheckpointWriteError) as exc:
        return exc
    return None


@atexit.register
def _report_at_exit() -> None:
    error = settle_checkpoint_write()
    if error is not None:  # never lost: the training loop should have called wait_for_checkpoint
        print(f"draftline: error: {error}", file=sys.stderr, flush=True)


def prune(folder: Path, keep: int) -> None:
    checkpoints = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in checkpoints[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(".tmp-step-*"):  # left by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)


def check_disk_space(run_dir: str | Path, num_trained_params: int, keep: int) -> str | None:
    """Whether the run directory's disk can hold ``keep + 1`` checkpoints (the newest is written before the
    oldest is removed); None if it can, else what is missing, in words."""
    run_dir = Path(run_dir)
    folder = run_dir if run_dir.exists() else run_dir.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    size = checkpoint_bytes(num_trained_params)
    existing = len([p for p in (run_dir / run_files.CHECKPOINTS).glob("step-*") if p.is_dir()]) if run_dir.exists() else 0
    needed = max(0, keep + 1 - existing) * size
    if free >= needed:
        return None
    return (f"{folder} has {_bytes(free)} free; the run keeps {keep} checkpoint(s) of about {_bytes(size)} and "
            f"writes the next before removing the oldest, which needs {_bytes(needed)} more")
