"""Where metrics records go: metrics.jsonl, TensorBoard, W&B, or nowhere (non-logging ranks).

A record is one dict with ``kind``, ``time``, ``elapsed_s`` (docs/ARCHITECTURE.md). Every logger
takes the same records; ``open_loggers`` builds the set a run asked for.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Protocol

from draftline import run_files
from draftline.errors import DraftlineError
from draftline.files import append_line, disk_full_error, open_for_append

# Lists whose entries are numbered from 1: block slots 1..B-1 and committed lengths 1..B.
_ONE_BASED_LISTS = {"accuracy_by_position", "acceptance_by_position", "acceptance_hist"}
# Fields that describe a record rather than measure something (tau_step: when the tau shown was measured;
# num_epochs and layout: the run's shape).
_NOT_SCALARS = {"kind", "time", "step", "tau_step", "num_epochs", "layout"}


class MetricsLogger(Protocol):
    """Takes metrics records; ``close`` flushes and releases files."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null: strict JSON readers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        return _json_safe(value.item())
    return value


def flatten_scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of a record as ``(name, value)``: lists become ``name/i``, dicts ``name/key``.

    Entries of ``gpus`` are named by their rank (``gpus/3/util``) so a chart follows one GPU.
    """
    for key, value in record.items():
        if not prefix and key in _NOT_SCALARS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, (int, float)):
            yield name, float(value)
        elif isinstance(value, dict):
            yield from flatten_scalars(value, f"{name}/")
        elif isinstance(value, (list, tuple)):
            base = 1 if key in _ONE_BASED_LISTS else 0
            for i, item in enumerate(value):
                label = item.get("rank", i) if isinstance(item, dict) else i + base
                if isinstance(item, dict):
                    yield from flatten_scalars({k: v for k, v in item.items() if k != "rank"}, f"{name}/{label}/")
                elif isinstance(item, (int, float)) and not isinstance(item, bool):
                    yield f"{name}/{label}", float(item)


class NullLogger:
    """For ranks that do not log: takes everything, writes nothing."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per line, each written whole or not at all (``files.append_line``: a full disk
    is named and leaves no half line); unbuffered, so a crash loses at most the record being written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = open_for_append(self.path)
        self._lock = threading.Lock()  # the monitor's thread and the training thread both log: one record at a time

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(_json_safe(record), allow_nan=False) + "\n"
        with self._lock:
            append_line(self._fd, line, self.path, "a metrics record to",
                        "free space there (the run's checkpoints need it too) or move --out to a larger disk")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TensorBoardLogger:
    """Scalars of each record under ``<kind>/<field>`` at the record's ``step``.

    The ``start`` record's config goes in as text, once.
    """

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir))
        _quiet_tensorboard_thread_errors()

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "metrics")
        step = int(record.get("step") or 0)
        try:
            if kind == "start":
                config = {k: v for k, v in record.items() if k not in ("kind", "time")}
                self._writer.add_text("start", "```\n" + json.dumps(_json_safe(config), indent=2) + "\n```", step)
                return
            wall_time = record.get("time")
            for name, value in flatten_scalars(record):
                self._writer.add_scalar(f"{kind}/{name}", value, step, walltime=wall_time)
            self._writer.flush()
        except OSError as exc:  # its writer thread's error, raised here (a record cut short fails its checksum)
            raise self._named(exc) from exc

    def _named(self, exc: OSError) -> Exception:
        return disk_full_error(exc, self.log_dir / "events.out.tfevents.*", "TensorBoard events to",
                               "the events before are readable (TensorBoard skips a record cut short)",
                               "free space there or train with --no-tensorboard (metrics.jsonl has every record)") or exc

    def close(self) -> None:
        try:
            self._writer.close()
        except OSError as exc:
            raise self._named(exc) from exc


def _quiet_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread re-raises a write that failed (a full disk), which Python prints as a
    traceback; ``TensorBoardLogger.log`` raises that error, named, on the run's next record instead."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard: its thread's errors print as they are
        return
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


class WandbLogger:
    """Weights & Biases, imported only when asked for."""

    def __init__(self, run_dir: str | Path, project: str | None = None, config: dict[str, Any] | None = None):
        try:
            import wandb
        except ImportError as error:
            raise DraftlineError(
                "W&B logging was asked for but the wandb package is not installed: "
                "`pip install 'draftline[wandb]'`, or leave out --wandb"
            ) from error
        self._run = wandb.init(project=project or "draftline", dir=str(run_dir), config=config)

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "metrics")
        if kind == "start":  # the run's resolved config and topology, as W&B's run config (once per start)
            self._run.config.update(_json_safe({k: v for k, v in record.items() if k in ("config", "topology", "mode")}),
                                    allow_val_change=True)
            return
        values = {f"{kind}/{name}": value for name, value in flatten_scalars(record)}
        if values:
            self._run.log(values, step=int(record["step"]) if record.get("step") is not None else None)

    def close(self) -> None:
        self._run.finish()


class CombinedLogger:
    """Sends each record to several loggers."""

    def __init__(self, loggers: list[MetricsLogger]):
        self.loggers = list(loggers)

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def open_loggers(
    run_dir: str | Path,
    tensorboard: bool = True,
    wandb: bool = False,
    wandb_project: str | None = None,
    is_logging_rank: bool = True,
) -> MetricsLogger:
    """The run's loggers: ``RUN_DIR/metrics.jsonl`` always, ``RUN_DIR/tensorboard/`` and W&B if asked.

    Non-logging ranks get a ``NullLogger`` so callers never branch on the rank.
    """
    if not is_logging_rank:
        return NullLogger()
    run_dir = Path(run_dir)
    loggers: list[MetricsLogger] = []
    try:
        if wandb:  # first: it is the one that can fail on a missing package
            loggers.append(WandbLogger(run_dir, wandb_project))
        loggers.append(JsonlLogger(run_dir / run_files.METRICS))
        if tensorboard:
            loggers.append(TensorBoardLogger(run_dir / run_files.TENSORBOARD))
    except Exception:
        for logger in loggers:
            logger.close()
        raise
    return CombinedLogger(loggers)
