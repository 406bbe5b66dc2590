"""The run directory: is this a fresh start or a resume, and the record of every start.

``RUN_DIR/config.json`` holds the resolved config; ``RUN_DIR/starts.jsonl`` one line per start
(fresh, resume, or a torchrun restart) so nobody has to guess what a directory holds. Starting over a
directory that has checkpoints needs ``--from-scratch``, which moves the old run aside instead of
deleting it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from draftline.checkpoint.state import latest_checkpoint, record_start
from draftline.config import TrainConfig
from draftline.errors import DraftlineError

_RUN_FILES = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "report", "failure.json", "config.json")


@dataclass
class StartDecision:
    mode: str  # "fresh", "resume" or "restart" (torchrun restarted the job)
    checkpoint: Path | None


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def decide_start(config: TrainConfig) -> StartDecision:
    """What to do with RUN_DIR given --resume / --from-scratch (pure apart from reading the dir)."""
    run_dir = Path(config.out)
    latest = latest_checkpoint(run_dir) if run_dir.exists() else None
    restarted = restart_count() > 0
    if config.checkpoint.resume or restarted:
        if latest is None:
            if restarted:
                return StartDecision("restart", None)
            raise DraftlineError(
                f"{run_dir}: --resume, but there is no checkpoint to resume from; drop --resume to start a new run"
            )
        return StartDecision("restart" if restarted else "resume", latest)
    if latest is not None and not config.checkpoint.from_scratch:
        raise DraftlineError(
            f"{run_dir} already holds a run (latest checkpoint {latest.name}); pass --resume to continue it "
            "or --from-scratch to start over (the old run is moved aside, not deleted)"
        )
    return StartDecision("fresh", None)


def prepare_run_dir(config: TrainConfig, decision: StartDecision) -> None:
    """Create RUN_DIR; on a fresh start over an old run, move the old run's files aside."""
    run_dir = Path(config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    if decision.mode == "fresh" and config.checkpoint.from_scratch:
        present = [name for name in _RUN_FILES if (run_dir / name).exists()]
        if present:
            aside = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for name in present:
                shutil.move(str(run_dir / name), str(aside / name))
            print(f"draftline: --from-scratch: moved the previous run's {', '.join(present)} to {aside}")
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def log_start(config: TrainConfig, decision: StartDecision, *, step: int, world_size: int, topology: dict) -> None:
    record_start(
        config.out,
        {
            "time": time.time(),
            "mode": decision.mode,
            "from_checkpoint": str(decision.checkpoint) if decision.checkpoint else None,
            "step": step,
            "restart_count": restart_count(),
            "world_size": world_size,
            "topology": topology,
            "host": socket.gethostname(),
        },
    )
