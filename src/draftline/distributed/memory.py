"""Device memory: the card this process may use, what it may allocate, and an out-of-memory error told
with the batch it hit.

The card (``--gpu-memory-gib``, ``DeviceBudget``): a budget for the device's whole use as CUDA counts it
(``cudaMemGetInfo``'s total - free, what nvidia-smi and torch's out-of-memory message quote), so that a
smaller GPU simulated on a larger one has exactly the smaller one's memory. What lies outside this process's
caching allocator (CUDA's context, the kernels' modules, library workspaces, NCCL's buffers, other
processes) is measured (``cap_device``) and the allocator is capped to the rest
(``torch.cuda.set_per_process_memory_fraction``); it is measured again when the outside has grown (after
preflight's warm-up, which loads the kernels and makes the workspaces: ``refresh_cap``).

The limit is what this process may really allocate: the allocator's cap, and no more than is free now plus
what this process's allocator already holds (other processes may hold the rest). Preflight checks against it;
a mid-run out-of-memory error quotes it.

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

from draftline.errors import DraftlineError

_GIB = 2**30
_CONTEXT = "draftline_oom_context"  # the attribute of the exception that carries the context


def gib(num_bytes: float, digits: int = 1) -> str:
    return f"{num_bytes / _GIB:.{digits}f} GiB"


# ---------------------------------------------------------------------------------------- the card
@dataclass
class DeviceBudget:
    """``--gpu-memory-gib``: the device's whole use this process may reach, and how it splits."""

    whole: float
    """Bytes of the device in use at most, everything counted (``cudaMemGetInfo``: total - free)."""
    outside: float
    """Bytes in use on the device outside this process's caching allocator when measured: CUDA's context and
    kernels, library workspaces, NCCL, other processes."""
    total: float
    """The device's memory (``cudaMemGetInfo``'s total)."""

    @property
    def allocator(self) -> float:
        """Bytes this process's caching allocator may reserve: the budget less what lies outside it."""
        return self.whole - self.outside

    def describe(self) -> str:
        return (f"{gib(self.whole, 2)} of the device in all (--gpu-memory-gib) - {gib(self.outside, 2)} outside the "
                f"allocator (CUDA context, libraries, other processes) = {gib(self.allocator, 2)} for the allocator")


_BUDGETS: dict[int, float] = {}
"""The card of each device of this process (index -> bytes), once ``cap_device`` set it."""


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def device_in_use(device: torch.device | int) -> tuple[float, float]:
    """(bytes in use on the device, the device's bytes) as CUDA counts them: ``cudaMemGetInfo``."""
    free, total = torch.cuda.mem_get_info(_index(device))
    return float(total - free), float(total)


def cap_device(device: torch.device | int, whole_gib: float) -> DeviceBudget:
    """Bound the device's whole use at ``whole_gib``: measure what lies outside this process's allocator now
    and cap the allocator to the rest. Refused when the rest is nothing."""
    _BUDGETS[_index(device)] = whole_gib * _GIB
    return refresh_cap(device)


def refresh_cap(device: torch.device | int) -> DeviceBudget | None:
    """Measure again what lies outside the allocator and move its cap (None: no card set for ``device``)."""
    index = _index(device)
    whole = _BUDGETS.get(index)
    if whole is None:
        return None
    used, total = device_in_use(index)
    budget = DeviceBudget(whole, max(0.0, used - float(torch.cuda.memory_reserved(index))), total)
    if budget.whole > total:
        raise DraftlineError(f"--gpu-memory-gib {whole / _GIB:g}: the device has only {gib(total, 2)} "
                             "(as CUDA counts it); give at most that, or leave it unset for the whole device")
    if budget.allocator <= 0.5 * _GIB:
        raise DraftlineError(
            f"--gpu-memory-gib {whole / _GIB:g}: {gib(budget.outside, 2)} of the device are already in use outside "
            "this process's allocator (CUDA's context, other processes), which leaves it nothing: give a larger "
            "budget or free the GPU (nvidia-smi names the processes)")
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget.allocator / total), index)
    return budget


def device_budget(device: torch.device | int) -> float | None:
    """The card's bytes set for ``device`` (``cap_device``), or None."""
    return _BUDGETS.get(_index(device))


# ---------------------------------------------------------------------------------------- the limit
@dataclass
class MemoryLimit:
    """What this process may allocate on its device."""

    total: float  # the device's memory
    fraction: float  # the caching allocator's per-process fraction (1.0 unless set)
    free: float  # free on the device now (other processes and this one's cache excluded)
    reserved: float  # held by this process's allocator now
    headroom: float  # kept free by preflight (memory_headroom_gib)
    whole: float | None = None  # the card (--gpu-memory-gib), if one is set
    outside: float | None = None  # with a card: in use outside the allocator when the cap was last measured

    @property
    def usable(self) -> float:
        return min(self.total * self.fraction, self.free + self.reserved)

    @property
    def limit(self) -> float:
        return self.usable - self.headroom

    def why(self) -> str:
        """Where ``usable`` comes from: the free memory, the card or fraction cap, or the whole device."""
        if self.free + self.reserved < self.total * self.fraction:
            return (f"{gib(self.free)} free on the device + {gib(self.reserved)} this process holds; "
                    "other processes use the rest")
        if self.whole is not None and self.outside is not None:
            return (f"--gpu-memory-gib {self.whole / _GIB:g} of the device less {gib(self.outside, 2)} outside the "
                    "allocator: CUDA context, libraries, other processes")
        if self.fraction < 1.0:
            return f"{self.fraction:.0%} of the device's {gib(self.total)} (torch.cuda.set_per_process_memory_fraction)"
        return f"the whole device, {gib(self.total)}"

    def describe(self) -> str:
        return f"limit {gib(self.limit)} = {gib(self.usable)} this process may use ({self.why()}) - {gib(self.headroom)} headroom"


def memory_limit(device: torch.device, headroom_gib: float, *, refresh: bool = True) -> MemoryLimit:
    """What this process may allocate now; ``refresh``: with a card set, measure what lies outside the allocator
    again first (it grows as kernels load and workspaces are made) and move the cap."""
    index = _index(device)
    budget = refresh_cap(index) if refresh else None
    free, total = torch.cuda.mem_get_info(index)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.5
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    whole = _BUDGETS.get(index)
    outside = None  # with a card: what the cap leaves outside the allocator (its cap is whole - outside)
    if whole is not None:
        outside = budget.outside if budget is not None else max(0.0, whole - fraction * total)
    return MemoryLimit(float(total), float(fraction), float(free), float(torch.cuda.memory_reserved(index)),
                       headroom_gib * _GIB, whole, outside)


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
            limit = memory_limit(device, 0.0, refresh=False)
            message += (f"; this process may use {gib(limit.usable)} ({limit.why()}): its allocator held "
                        f"{gib(limit.reserved)}, the peak allocated was {gib(_peak_allocated(device))}")
        except Exception:  # noqa: BLE001 - the device may be unusable after the error; the rest still says enough
            pass
    advice = context.advice if context is not None else (
        "lower --token-budget or --max-query-rows, or enable --activation-checkpointing")
    return f"{message}. To fit: {advice}"
