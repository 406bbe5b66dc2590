"""The CPU cores this process may run on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores of this process's affinity mask (``taskset``, a container's cpuset, a scheduler's
    allocation), or every core of the machine where the system keeps no mask. ``os.cpu_count()`` counts
    the machine's cores, so ranks sized by it oversubscribe a process limited to a few."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
