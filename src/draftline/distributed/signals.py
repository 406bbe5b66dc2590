"""SIGINT/SIGTERM: a clean stop at the next optimizer step boundary once training runs; before
that, an ``Interrupted`` exception that the command line turns into one message and exit code."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

# A repeat of the signal this soon is the same request, not a second one: a scheduler (Slurm,
# systemd) signals every process of the job, and the ``--gpus`` launcher forwards its own copy.
SAME_REQUEST_S = 2.0


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM before the training line handles them (imports, process group, set-up)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def handlers_kept():
    """SIGINT's and SIGTERM's handlers put back as they were when the block ends. ``draftline train`` run in
    a process that goes on afterwards (a test session, a notebook) must not leave its handlers behind: one
    that turns SIGTERM into a stop request for a run that is over makes that process ignore SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, handler)


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


def interrupt_until_training() -> None:
    """SIGTERM (as SIGINT already does) raises ``Interrupted`` until ``StopSignals`` takes over, so a
    stop during start-up also ends with a message instead of a silent death or a traceback."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_interrupted)


class StopSignals:
    """SIGINT/SIGTERM ask for a clean stop at the next step boundary; a second one exits at once."""

    def __init__(self):
        self.requested = False
        self._first: float | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        now = time.monotonic()
        if self.requested:
            if now - self._first < SAME_REQUEST_S:
                return
            os._exit(128 + signum)
        self.requested = True
        self._first = now
        print(f"draftline: {signal.Signals(signum).name}: stopping at the next step boundary "
              "(checkpoint, then exit); send it again to exit at once", file=sys.stderr, flush=True)
