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

With several drafter ranks the run directory must be on a file system every rank sees (one node's
disk, or a shared one across nodes). ``wait_for_checkpoint()`` blocks until the write in flight is
on disk and raises its error. A failed write (a full disk) leaves the previous checkpoints and
``latest`` as they were, and says what the disk lacks.
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
import threading
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME, drafter_config_dict, load_drafter
from draftline.errors import DraftlineError, MachineError

TRAINER_STATE = "trainer.pt"
TRAINER_JSON = "trainer.json"
STATE_DIR = "state"
MANIFEST = "manifest.json"
FORMAT = 2
"""1: optimizer state inside trainer.pt (one drafter); 2: ``state/`` written by torch.distributed.checkpoint."""

# One process saves and loads with ``no_dist``; DCP still warns (in its writer thread too) that it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


# ------------------------------------------------------------------------------------------ saving
@dataclass
class _Pending:
    """A save in flight on this rank."""

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


def _sha256(path: Path) -> str:
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


def _finish(pending: _Pending) -> Path:
    """The first drafter's part once DCP's write is done everywhere: the rest of the files, manifest, rename."""
    pending.upload.result()
    if not pending.first:
        return pending.target
    tmp, final = pending.tmp, pending.target
    try:
        (tmp / "drafter").mkdir(exist_ok=True)
        save_file(pending.weights, str(tmp / "drafter" / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "drafter" / CONFIG_NAME).write_text(json.dumps(pending.drafter_config, indent=2) + "\n")
        torch.save(pending.payload, tmp / TRAINER_STATE)
        (tmp / TRAINER_JSON).write_text(json.dumps(pending.summary, indent=2) + "\n")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": pending.step, "files": files}, indent=2) + "\n")
        _fsync(manifest)
        for folder in (tmp / "drafter", tmp / STATE_DIR, tmp):
            _fsync(folder)
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
    _prune(final.parent, pending.keep)
    return final


class _Writer:
    """One save in flight at a time; its error is kept until the training thread asks."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.pending: _Pending | None = None
        self.previous: Path | None = None  # the last checkpoint written whole

    def start(self, pending: _Pending) -> Path:
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
            pointer = pending.target.parent / "latest" if pending else None
            if previous is None and pointer is not None and pointer.is_file():
                previous = pointer.parent / pointer.read_text().strip()
            raise _write_error(exc, pending, previous) from None
        return self.previous


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (DCP wraps its ranks' errors in a CheckpointException)."""
    seen = 0
    while exc is not None and seen < 12:
        if isinstance(exc, OSError):
            return exc
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


def _write_error(exc: BaseException, pending: _Pending | None, previous: Path | None
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


_WRITER = _Writer()


def checkpoint_bytes(num_trained_params: int, *, legacy: bool = False) -> int:
    """About how many bytes a checkpoint takes: fp32 weights twice (``drafter/`` and ``state/``) and the two
    fp32 AdamW moments: 16 bytes per trained weight."""
    return 16 * num_trained_params


def _staged_state(drafter, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(drafter, optimizer)
    return {"model": model_state, "optim": optim_state}


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

    Every drafter rank calls this at the same step (``group``: ``shard.DrafterGroup``; None: one drafter
    in one process). Waits first for the previous write (and raises its error, a ``DraftlineError``).
    Returns the directory the checkpoint will have; ``wait=True`` (or ``wait_for_checkpoint()``) returns
    once it is on disk. A save made while an exception is being handled (a failure's last checkpoint)
    waits too: the process may end with ``os._exit`` right after, which would cut a background write.
    """
    import torch.distributed.checkpoint as dcp

    from draftline.distributed.shard import DrafterGroup

    group = group or DrafterGroup()
    _WRITER.wait()
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
    pending = _Pending(state.step, target, tmp, upload, group.is_first, keep=keep)
    if group.is_first:
        params = sum(t.numel() for t in weights.values())
        state = copy.deepcopy(state)
        state.num_drafters = group.num_drafters
        pending.weights = {name: t.contiguous() for name, t in weights.items()}
        pending.drafter_config = drafter_config_dict(_unwrapped(drafter).config, torch.float32)
        pending.payload = {"format": FORMAT, "step": state.step, "next_seq": state.next_seq,
                           "in_flight": list(state.in_flight), "counters": copy.deepcopy(state.counters),
                           "config": copy.deepcopy(state.config), "scheduler": _to_cpu(scheduler.state_dict()),
                           "rng": rng_state()}
        pending.summary = state.summary()
        pending.size_hint = checkpoint_bytes(params)
    path = _WRITER.start(pending)
    if wait or sys.exc_info()[0] is not None:
        _WRITER.wait()
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


def wait_for_checkpoint() -> Path | None:
    """Block until the checkpoint being written is on disk; raise its error (``DraftlineError``,
    naming the checkpoint, the cause and the fix). Returns the last checkpoint written whole."""
    return _WRITER.wait()


def settle_checkpoint_write() -> Exception | None:
    """Block until the checkpoint being written is on disk or failed; its error returned, not raised (a
    failing run's handler: the write is then usually part of the failure)."""
    try:
        _WRITER.wait()
    except (DraftlineError, CheckpointWriteError) as exc:
        return exc
    return None


@atexit.register
def _report_at_exit() -> None:
    error = settle_checkpoint_write()
    if error is not None:  # never lost: the training loop should have called wait_for_checkpoint
        print(f"draftline: error: {error}", file=sys.stderr, flush=True)


def _prune(folder: Path, keep: int) -> None:
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
    existing = len([p for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir()]) if run_dir.exists() else 0
    needed = max(0, keep + 1 - existing) * size
    if free >= needed:
        return None
    return (f"{folder} has {_bytes(free)} free; the run keeps {keep} checkpoint(s) of about {_bytes(size)} and "
            f"writes the next before removing the oldest, which needs {_bytes(needed)} more")


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
    files against its manifest first (the first drafter already did, when it chose the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from draftline.distributed.shard import DrafterGroup

    path = Path(path)
    group = group or DrafterGroup()
    _WRITER.wait()
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
    return read_trainer_state(path)


def _load_format_1(path: Path, payload: dict, drafter, optimizer, group) -> None:
    """A checkpoint from before ``state/``: the optimizer state in trainer.pt, for one drafter."""
    if group.sharded:
        raise DraftlineError(f"{path}: written by an earlier draftline with the optimizer state in trainer.pt, which "
                             "loads on one drafter only; resume it on one drafter, save, then resume on more")
    device = next(drafter.parameters()).device
    saved = load_drafter(path / "drafter", device=device, dtype=torch.float32)
    with torch.no_grad():
        for (_, param), (_, value) in zip(drafter.state_dict().items(), saved.state_dict().items()):
            param.copy_(value)
    optimizer.load_state_dict(payload["optimizer"])


def record_start(run_dir: str | Path, entry: dict[str, Any]) -> None:
    """Append this start (fresh or resume, from which step) to RUN_DIR/starts.jsonl."""
    path = Path(run_dir) / "starts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
