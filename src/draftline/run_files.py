"""The run directory's layout: every file and folder a training run writes in ``--out``, named once.

::

    RUN_DIR/
      run.lock            the one live run that owns the directory (distributed/rundir.py)
      config.json         the resolved config; starts.jsonl: one line per start (fresh, resume, restart)
      checkpoints/        step-00000120/ ... and ``latest`` (checkpoint/state.py, checkpoint/writer.py)
      final/              the trained drafter, exported (bf16)
      metrics.jsonl       the monitor's and the evaluations' records (docs/ARCHITECTURE.md); tensorboard/
      failure.json        a failed run's message, step and checkpoint to resume from
      ranks/rank-N.json   which process is which (role, host, GPU, pid), for operators and the launcher
      preflight/rank-N.json   each start's measured peaks and library versions
      trace/              with --trace: steps.jsonl (each step's loss), drafter-N.jsonl (each batch)
      report/             ``draftline report``'s plots and summary
"""

from __future__ import annotations

LOCK = "run.lock"
CONFIG = "config.json"
STARTS = "starts.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
"""In ``CHECKPOINTS``: the name of the newest checkpoint written whole."""
FINAL = "final"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
FAILURE = "failure.json"
RANKS = "ranks"
PREFLIGHT = "preflight"
TRACE = "trace"
TRACE_STEPS = "steps.jsonl"
REPORT = "report"
DATA = "data"
"""Where ``train`` suggests ``draftline prepare`` writes a dataset it was given unprepared."""

MOVED_ASIDE = (CHECKPOINTS, FINAL, METRICS, TENSORBOARD, REPORT, FAILURE, CONFIG)
"""What ``--from-scratch`` moves aside from a directory that holds a run."""


def rank_file(rank: int) -> str:
    """A rank's file in ``RANKS`` and ``PREFLIGHT``."""
    return f"rank-{rank}.json"


def drafter_trace(rank: int) -> str:
    """A drafter's file in ``TRACE``: each batch it trained."""
    return f"drafter-{rank}.jsonl"
