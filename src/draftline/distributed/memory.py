"""Device memory: what this process may use, and an out-of-memory error told with the batch it hit.

The limit is what this process may really use, not the device: the device's memory times the
caching allocator's per-process fraction (``torch.cuda.set_per_process_memory_fraction``), and no
more than is free now plus what this process's allocator already holds (other processes may hold
the rest). Preflight checks against it; a mid-run out-of-memory error quotes it.

A pass that runs out of memory in the middle of a run is wrapped in ``out_of_memory_context``: the
worker says which pass of which batch it was and how big (tokens, documents, query rows), and what
to lower; ``describe_out_of_memory`` turns the error into one message with those, the limit and
the allocator's figures (CUDA's own text quotes the whole device).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

_GIB = 2**30
_CONTEXT = "draftline_oom_context"  # the attribute of the exception that carries the context


def gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.1f} GiB"


@dataclass
class MemoryLimit:
    """What this process may allocate on its device."""

    total: float  # the device's memory
    fraction: float  # the caching allocator's per-process fraction (1.0 unless set)
    free: float  # free on the device now (other processes and this one's cache excluded)
    reserved: float  # held by this process's allocator now
    headroom: float  # kept free by preflight (memory_headroom_gib)

    @property
    def usable(self) -> float:
        return min(self.total * self.fraction, self.free + self.reserved)

    @property
    def limit(self) -> float:
        return self.usable - self.headroom

    def why(self) -> str:
        """Where ``usable`` comes from: the free memory, the fraction cap or the whole device."""
        if self.free + self.reserved < self.total * self.fraction:
            return (f"{gib(self.free)} free on the device + {gib(self.reserved)} this process holds; "
                    "other processes use the rest")
        if self.fraction < 1.0:
            return f"{self.fraction:.0%} of the device's {gib(self.total)} (torch.cuda.set_per_process_memory_fraction)"
        return f"the whole device, {gib(self.total)}"

    def describe(self) -> str:
        return f"limit {gib(self.limit)} = {gib(self.usable)} this process may use ({self.why()}) - {gib(self.headroom)} headroom"


def memory_limit(device: torch.device, headroom_gib: float) -> MemoryLimit:
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.5
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    return MemoryLimit(float(total), float(fraction), float(free), float(torch.cuda.memory_reserved(index)),
                       headroom_gib * _GIB)


def _peak_allocated(device: torch.device) -> float:
    return float(torch.cuda.max_memory_allocated(device))


# ---------------------------------------------------------------------------------------- mid-run
@dataclass
class OutOfMemoryContext:
    """What a worker knew when its pass ran out of memory."""

    where: str  # "the drafter's pass 2 of batch 17 (step 5)"
    sizes: str  # "8,192 tokens in 12 documents; the pass: 1,024 query rows over 4,096 context tokens"
    advice: str  # what to lower, with the values now
    device: torch.device


def find_out_of_memory(exc: BaseException | None) -> torch.OutOfMemoryError | None:
    """``exc`` if it is an out-of-memory error, or the one it was raised from (a compiler error can wrap
    one raised while it benchmarked kernels)."""
    for _ in range(8):
        if exc is None or isinstance(exc, torch.OutOfMemoryError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def out_of_memory_context(device: torch.device, context: Callable[[], OutOfMemoryContext]):
    """Attach ``context()`` to an out-of-memory error raised inside (the innermost one wins)."""
    try:
        yield
    except Exception as exc:
        oom = find_out_of_memory(exc)
        if oom is not None and getattr(oom, _CONTEXT, None) is None:
            setattr(oom, _CONTEXT, context())
        raise


def context_of(exc: BaseException) -> OutOfMemoryContext | None:
    return getattr(exc, _CONTEXT, None)


def describe_out_of_memory(exc: torch.OutOfMemoryError) -> str:
    """The cause in words: which pass of which batch, its size, the process's limit, what to lower."""
    context = context_of(exc)
    text = str(exc)
    message = "out of GPU memory"
    if context is not None:
        message += f" in {context.where} ({context.sizes})"
    tried = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if tried:
        message += f"; it tried to allocate {tried.group(1)} more"
    elif text:
        message += f" ({text.splitlines()[0][:160]})"
    device = context.device if context is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and device.type == "cuda":
        try:
            limit = memory_limit(device, 0.0)
            message += (f"; this process may use {gib(limit.usable)} ({limit.why()}): its allocator held "
                        f"{gib(limit.reserved)}, the peak allocated was {gib(_peak_allocated(device))}")
        except Exception:  # noqa: BLE001 - the device may be unusable after the error; the rest still says enough
            pass
    advice = context.advice if context is not None else (
        "lower --token-budget or --max-query-rows, or enable --activation-checkpointing")
    return f"{message}. To fit: {advice}"
