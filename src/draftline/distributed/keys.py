"""Every key the ranks of a job write in its store (torchrun's TCPStore), named once.

The run's keys live under ``JOB_PREFIX`` of the start's own namespace (``start_prefix``: torchrun keeps one
store across its restarts, so each start writes under its restart count and never reads a key of the start
before). Who writes what:

- rank 0: ``SETUP`` (the run's start, which every rank waits for) or ``SETUP_ERROR``;
- every rank: ``rank_key`` (who it is), ``heartbeat_key`` (its heartbeat and shared numbers), ``fail_key``
  (its failure's cause), ``done_key`` (it finished); the first rank to name a culprit: ``ABORT``;
- the first drafter: ``RUN_OVER`` (the run ended: later waits are a clean stop, not a failure); a target asked
  to stop by a signal: ``STOP_REQUESTED``;
- a drafter: ``claim_key`` (the batch it will receive; the target that computes it reads and deletes it).
"""

from __future__ import annotations

JOB_PREFIX = "job/"
"""The prefix of the run's own keys (the process groups' keys are torch's, beside them)."""

SETUP = "setup"
SETUP_ERROR = "setup_error"
ABORT = "abort"
RUN_OVER = "run_over"
STOP_REQUESTED = "stop_requested"


def start_prefix(restart: int) -> str:
    """The namespace of one start of the job (torchrun's restart count)."""
    return f"draftline/start-{restart}/"


def rank_key(rank: int) -> str:
    return f"rank/{rank}"


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


def fail_key(rank: int) -> str:
    return f"fail/{rank}"


def done_key(rank: int) -> str:
    return f"done/{rank}"


def claim_key(seq: int) -> str:
    return f"claim/{seq}"
