"""Blocking waits that poll ``Health.check()``: a failure anywhere in the run ends every wait.

Used by the transport, the workers and the gradient all-reduce; each returns the seconds it waited
(for the monitor's wait fractions).
"""

from __future__ import annotations

import queue as queue_module
import threading
import time

import torch.distributed as dist

from draftline.distributed.health import Health


def wait_work(work, health: Health) -> float:
    """Wait for a torch.distributed request while checking health; returns the seconds waited.

    NCCL requests are polled with ``is_completed`` (a CUDA event query), then ``wait`` orders the
    current stream after them. Gloo requests only complete inside ``wait``, so a helper thread
    blocks in it while this thread polls.
    """
    if dist.get_backend() != "gloo":
        waited = wait_for(work.is_completed, health)
        work.wait()
        return waited
    done = threading.Event()
    errors: list[BaseException] = []

    def block() -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the waiting thread
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=block, name="draftline-wait", daemon=True).start()
    waited = wait_for(done.is_set, health)
    if errors:
        raise errors[0]
    return waited


def queue_put(q, item, health: Health, poll_s: float = 0.05, check=None) -> float:
    """``q.put(item)`` on a bounded queue, checking health (and ``check()``, which may raise, e.g.
    the consumer thread's error) while it is full; returns seconds blocked."""
    start = time.perf_counter()
    while True:
        health.check()
        if check is not None:
            check()
        try:
            q.put(item, timeout=poll_s)
            return time.perf_counter() - start
        except queue_module.Full:
            continue


def queue_get(q, health: Health, poll_s: float = 0.05):
    """``q.get()``, checking health while it is empty; returns (item, seconds waited)."""
    start = time.perf_counter()
    while True:
        health.check()
        try:
            item = q.get(timeout=poll_s)
            return item, time.perf_counter() - start
        except queue_module.Empty:
            continue


def wait_for(predicate, health: Health, *, sleep_s: float = 0.0005, max_sleep_s: float = 0.01) -> float:
    """Poll ``predicate`` until true, checking health between polls; returns the seconds waited."""
    start = time.perf_counter()
    delay = sleep_s
    while not predicate():
        health.check()
        time.sleep(delay)
        delay = min(delay * 2, max_sleep_s)
    return time.perf_counter() - start
