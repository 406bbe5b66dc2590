"""SIGINT/SIGTERM during training: a clean stop at the next optimizer step boundary."""

from __future__ import annotations

import os
import signal
import sys
import threading


class StopSignals:
    """SIGINT/SIGTERM ask for a clean stop at the next step boundary; a second one exits at once."""

    def __init__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        print(f"draftline: {signal.Signals(signum).name}: stopping at the next step boundary "
              "(checkpoint, then exit); send it again to exit at once", file=sys.stderr, flush=True)
