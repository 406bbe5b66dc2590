"""Where metrics records go: metrics.jsonl, TensorBoard, W&B, or nowhere (non-logging ranks).

A record is one dict with ``kind``, ``time``, ``elapsed_s`` (docs/ARCHITECTURE.md). Every logger
takes the same records; ``open_loggers`` builds the set a run asked for.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Protocol

from draftline import run_files
from draftline.errors import DraftlineError

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
    """Appends one JSON object per line; flushed per line so a crash loses at most the last one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger:
    """Scalars of each record under ``<kind>/<field>`` at the record's ``step``.

    The ``start`` record's config goes in as text, once.
    """

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "metrics")
        step = int(record.get("step") or 0)
        if kind == "start":
            config = {k: v for k, v in record.items() if k not in ("kind", "time")}
            self._writer.add_text("start", "```\n" + json.dumps(_json_safe(config), indent=2) + "\n```", step)
            return
        wall_time = record.get("time")
        for name, value in flatten_scalars(record):
            self._writer.add_scalar(f"{kind}/{name}", value, step, walltime=wall_time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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
