"""Reading RUN_DIR/metrics.jsonl (schema: docs/ARCHITECTURE.md) for reports.

Tolerant by design: a run killed mid-write leaves a truncated last line, older runs lack newer
fields, a resumed run has several ``start`` records. Unreadable lines are skipped and counted;
missing or non-finite values are simply absent from a series.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftline import run_files
from draftline.errors import DraftlineError


@dataclass
class Segment:
    """One start of the run (fresh, resume or restart) and the records it wrote."""

    start: dict
    records: list[dict] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        """Seconds from this start to its last record."""
        times = [r["time"] for r in self.records if _number(r.get("time")) is not None]
        begin = _number(self.start.get("time"))
        if begin is not None and times:
            return max(0.0, max(times) - begin)
        elapsed = [r["elapsed_s"] for r in self.records if _number(r.get("elapsed_s")) is not None]
        return max(elapsed, default=0.0)

    @property
    def topology(self) -> dict:
        topology = self.start.get("topology")
        return topology if isinstance(topology, dict) else {}

    @property
    def num_gpus(self) -> int:
        """GPUs this start held: 0 on CPU, else the world size (each rank drives one GPU)."""
        topology = self.topology
        if str(topology.get("device", "cuda")).startswith("cpu"):
            return 0
        size = self.start.get("world_size", topology.get("world_size"))
        if isinstance(size, int) and size > 0:
            return size
        gpus = [r.get("gpus") for r in self.records if isinstance(r.get("gpus"), list)]
        return len(gpus[-1]) if gpus else 0


@dataclass
class RunLog:
    path: Path
    records: list[dict]
    skipped_lines: list[int]
    """Line numbers that were not JSON objects (a truncated last line is the usual one)."""

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def segments(self) -> list[Segment]:
        segments: list[Segment] = []
        for record in self.records:
            if record.get("kind") == "start" or not segments:
                segments.append(Segment(record if record.get("kind") == "start" else {}))
            segments[-1].records.append(record)
        return segments

    def last(self, kind: str, key: str) -> Any:
        """The last present value of ``key`` among records of ``kind`` (None if never present)."""
        for record in reversed(self.of_kind(kind)):
            if record.get(key) is not None:
                return record[key]
        return None

    def series(self, kind: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) over the records of ``kind`` that have a finite number for both."""
        xs, ys = [], []
        for record in self.of_kind(kind):
            xv, yv = _number(record.get(x)), _number(record.get(key))
            if xv is not None and yv is not None:
                xs.append(xv)
                ys.append(yv)
        return xs, ys


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_run_log(run_dir: str | Path) -> RunLog:
    path = Path(run_dir) / run_files.METRICS
    if not path.is_file():
        raise DraftlineError(f"{run_dir}: no {run_files.METRICS}; pass the run directory a training run wrote (--out)")
    records, skipped = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped.append(line_no)
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                skipped.append(line_no)
    return RunLog(path, records, skipped)
