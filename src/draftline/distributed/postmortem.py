"""After torchrun: how the launched ranks ended, in one message and an exit code.

The ranks name their own failures (``failure``); what is left to the launcher is the case they could
not tell: a rank torchrun saw die first, before any watchdog named it (named here from the rank's own
record in RUN_DIR/ranks, and written to RUN_DIR/failure.json if no rank of this launch did), and a stop
by a signal (its exit code read from the logging rank's end record in RUN_DIR/metrics.jsonl).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from draftline import run_files
from draftline.distributed.rundir import live_owner


def stopped_exit_code(run_dir: Path, signum: int, started: float) -> int:
    """The exit code of a launch stopped by a signal, from how its ranks ended: the logging rank's
    end record in RUN_DIR/metrics.jsonl (its message, with the checkpoint, is above)."""
    end = last_end_record(run_dir / run_files.METRICS, started)
    if end is not None and end.get("status") in ("stopped", "finished"):
        return 0
    if end is not None and end.get("status") == "failed":
        return 1
    name = signal.Signals(signum).name
    print(f"draftline: stopped by {name} before the run saved a checkpoint of its stop; --resume continues "
          "from the latest checkpoint, if there is one", file=sys.stderr)
    return 128 + int(signum)


def last_end_record(path: Path, since: float) -> dict | None:
    """The last ``kind: "end"`` record written at or after ``since`` (read from the file's tail)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "end" and record.get("time", 0) >= since:
            return record
    return None


def name_failed_rank(run_dir: Path, rank: int, failure, started: float) -> str:
    """The first rank torchrun saw fail, named from its record in RUN_DIR/ranks (role, host, GPU, pid).

    torchrun may notice a killed rank and stop the others before their watchdogs name it; then this
    is the only place that can, so it also writes RUN_DIR/failure.json if no rank did.
    """
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    name = f"rank {rank} (pid {failure.pid})"
    record = run_dir / run_files.RANKS / run_files.rank_file(rank)
    try:
        info = json.loads(record.read_text())
        group = f"{info['group']}; " if info.get("group") else ""
        name = f"{info['role']} rank {rank} ({group}host {info['host']}, {info['gpu']}, pid {info['pid']})"
    except (OSError, ValueError, KeyError):
        pass
    message = f"{name} died ({how})"
    failure_json = run_dir / run_files.FAILURE
    try:
        written = json.loads(failure_json.read_text())["time"] >= started  # by a rank of this launch
    except (OSError, ValueError, KeyError):
        written = False
    if written:  # a rank's watchdog named the culprit; it may have stopped the others before torchrun saw it
        return json.loads(failure_json.read_text())["message"]
    if run_dir.is_dir() and live_owner(run_dir) is None:  # not into another live run's directory
        failure_json.write_text(json.dumps({"time": time.time(), "message": message, "step": None,
                                            "checkpoint": None}, indent=2) + "\n")
    return message
