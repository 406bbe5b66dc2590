"""The numbers a rank shares with the monitor: queue depths, rates, wait times, memory.

Each role updates its own section (``target``, ``drafter``, ``gpu``); the heartbeat carries the
whole record to the other ranks (``Health.peer_stats``), where the logging rank's monitor reads it.
"""

from __future__ import annotations

import threading


class SharedStats:
    """Sections of this rank's published numbers. Thread-safe: the target thread and the drafter
    of a colocated process each update their own section."""

    def __init__(self, on_new_section=None):
        self._lock = threading.Lock()
        self._record: dict = {}
        self._on_new_section = on_new_section
        """Called (no arguments) when a section appears for the first time: the heartbeat then carries it at
        once, not up to a beat later, so a short run's last monitor record already counts every rank."""

    def update(self, section: str, values: dict) -> None:
        """Replace one section (a new dict each time: readers never see a half-written record)."""
        with self._lock:
            new = section not in self._record
            self._record = {**self._record, section: values}
        if new and self._on_new_section is not None:
            self._on_new_section()

    def snapshot(self) -> dict:
        """The current record, ``{section: values}``; not to be modified."""
        return self._record
