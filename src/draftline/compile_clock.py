"""The time this process has spent compiling (``torch.compile``): dynamo's tracing, Inductor's code generation, a
backward compiled at its first use. (Kernels that a library builds when they first run, outside torch.compile, are
not in it.)

A compiled drafter meets now and then a shape it has not compiled for and compiles again: on an H100 at the
Qwen3.6-27B shape, steps of 19-24 s among steps of 1.6-3.3 s (docs/benchmarks/2026-12-the-card.md). Counted here,
the monitor shows it beside the rates it slowed (``compile_s`` and ``compiling_s`` of the status), so a slow window
is not mistaken for a slow line.

Counted from dynamo's compile callbacks, which run when the process's first compilation starts and its last
pending one ends (nested ones are not counted twice). ``install`` before the first compilation.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_state = {"installed": False, "unavailable": False, "total": 0.0, "since": None}


def _started(_args=None) -> None:
    with _lock:
        if _state["since"] is None:
            _state["since"] = time.perf_counter()


def _ended(_args=None) -> None:
    with _lock:
        if _state["since"] is not None:
            _state["total"] += time.perf_counter() - _state["since"]
            _state["since"] = None


def install() -> None:
    """Start counting; later calls do nothing while the count runs. ``torch._dynamo.reset()`` drops dynamo's
    callbacks, these among them: ``compile_seconds`` installs them again (what compiled in between is not counted)."""
    if _state["unavailable"]:
        return
    try:  # dynamo's callbacks are not public API: a torch without them leaves the figure unknown, not the run down
        from torch._dynamo.callback import callback_handler, on_compile_end, on_compile_start
    except ImportError:
        with _lock:
            _state["unavailable"], _state["total"] = True, float("nan")
        return
    with _lock:
        _state["installed"] = True
        if _started in callback_handler.start_callbacks:
            return
        _state["since"] = None  # a compilation that a reset cut off is over
    on_compile_start(_started)
    on_compile_end(_ended)


def compile_seconds() -> float:
    """Seconds spent compiling since ``install``, a compilation under way included (NaN where this torch has no
    compile callbacks; 0 before ``install``)."""
    if _state["installed"]:
        install()  # again after a torch._dynamo.reset()
    with _lock:
        since = _state["since"]
        return _state["total"] + (time.perf_counter() - since if since is not None else 0.0)


class Took:
    """The wall time since it was made, with the compiling in it: ``str`` gives "(12.3 s)", or
    "(153.2 s, 148.0 of it compiling)" when this process compiled meanwhile (``install`` first)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.compiled = compile_seconds()

    def __str__(self) -> str:
        wall = time.perf_counter() - self.started
        compiling = compile_seconds() - self.compiled
        return f"({wall:.1f} s, {compiling:.1f} of it compiling)" if compiling >= 0.05 else f"({wall:.1f} s)"
