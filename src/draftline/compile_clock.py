"""The time this process has spent compiling: ``torch.compile``'s (dynamo's tracing, Inductor's code generation, a
backward compiled at its first use) and Triton's just-in-time compilation of a library's kernels outside it
(flash-linear-attention's, draftline's own row kernels), each time a kernel meets arguments it has not been
compiled for.

A compiled drafter meets now and then a shape it has not compiled for and compiles again: on an H100 at the
Qwen3.6-27B shape, steps of 19-24 s among steps of 1.6-3.3 s (docs/benchmarks/2026-12-the-card.md). Counted here,
the monitor shows it beside the rates it slowed (``compile_s`` and ``compiling_s`` of the status), so a slow window
is not mistaken for a slow line.

torch.compile's time is counted from dynamo's compile callbacks, which run when the process's first compilation
starts and its last pending one ends (nested ones are not counted twice). Triton's is counted from its two
compile hooks (``triton.knobs.runtime``: ``jit_cache_hook`` before a kernel compiles, ``jit_post_compile_hook``
after), only while torch.compile is not compiling, whose time holds the kernels it builds; hooks set before are
still called. A Triton without those hooks, or none, leaves its kernels out. ``install`` before the first
compilation.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_state = {"installed": False, "unavailable": False, "total": 0.0, "since": None}
_triton_started: dict = {}
"""When each Triton kernel now compiling outside torch.compile began, by its function's name and its cache key."""


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
    _install_triton_hooks()


def _triton_key(info: dict):
    fn = info.get("fn")
    return getattr(fn, "name", None), info.get("key")


def _triton_compiling(info: dict) -> None:
    try:
        with _lock:
            if _state["since"] is None:  # torch.compile's own time holds the kernels it builds
                _triton_started[_triton_key(info)] = time.perf_counter()
    except Exception:  # noqa: BLE001 - a clock must never stop a kernel from compiling
        pass


def _triton_compiled(info: dict) -> None:
    try:
        with _lock:
            began = _triton_started.pop(_triton_key(info), None)
            if began is not None:
                _state["total"] += time.perf_counter() - began
    except Exception:  # noqa: BLE001
        pass


def _install_triton_hooks() -> None:
    """Count Triton's compilations outside torch.compile (see the module docstring); once per process."""
    try:
        from triton import knobs

        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except Exception:  # noqa: BLE001 - no Triton, or one without these hooks: its kernels are not counted
        return
    if getattr(before, "draftline_clock", False):
        return

    def compiling(**info):
        skip = before(**info) if before is not None else None
        if not skip:  # a hook before may take the compilation over; then there is nothing to time
            _triton_compiling(info)
        return skip

    def compiled(**info):
        _triton_compiled(info)
        return after(**info) if after is not None else None

    compiling.draftline_clock = compiled.draftline_clock = True
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = compiling, compiled


def compile_seconds() -> float:
    """Seconds spent compiling since ``install``: a torch.compile under way included, a Triton kernel once it is
    compiled (NaN where this torch has no compile callbacks; 0 before ``install``)."""
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
