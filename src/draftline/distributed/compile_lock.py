"""One pass at a time for the threads of one process (the colocated target and drafter).

torch.compile traces again when shapes change, and tracing in one thread breaks a compiled function
running in another. The threads share one device, so little overlap is lost. ``Health.compute_pass``
takes the lock around every pass of a process whose threads both run passes.
"""

from __future__ import annotations

import threading

COMPILE_LOCK = threading.Lock()
"""Held by each pass when several threads of this process run passes (colocated)."""
