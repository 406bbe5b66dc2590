"""Memory, utilisation and clock per GPU, for the status panel.

Sources, best first: NVML (``pynvml`` from the optional ``nvidia-ml-py`` package: device-wide
memory like nvidia-smi, utilisation, and the SM clock with what holds it back), then ``torch.cuda.mem_get_info`` (memory only), then
nothing ("n/a"). Nothing here raises: a monitor that crashes the run it watches is worse than a
blank cell.

Device memory is counted as CUDA counts it (``cudaMemGetInfo``, and NVML's second memory call, as nvidia-smi
shows it): what the driver keeps for itself is left out of both the used and the total figures (NVML's first
call counts it as used: 0.59 GiB on an H200), so that the total is the capacity torch reports and
``--gpu-memory-gib`` bounds. Beside it, for the rank's own device: the peak its allocator reached
(``torch.cuda.max_memory_allocated``, since preflight), the card set by ``--gpu-memory-gib``, and how often the
allocator ran out of room under it and had to free its cache to retry (each retry waits for the device: a run whose
count rises is at its card's edge and slower for it).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from draftline.distributed.memory import device_budget

_GIB = 1024**3


@dataclass
class GpuStats:
    """One device's memory and utilisation at one moment; None where unknown."""

    name: str
    """Device name as torch reports it (``"cpu"`` for a CPU rank)."""
    mem_used_gib: float | None = None
    """Memory in use on the whole device (all processes, CUDA's context included), GiB."""
    mem_total_gib: float | None = None
    """Device memory as CUDA counts it (the capacity torch reports), GiB."""
    util: float | None = None
    """Fraction of the last sample period a kernel was running (NVML), 0..1."""
    rank: int | None = None
    """Global rank that reported it; set by the caller."""
    role: str | None = None
    """``"target"``, ``"drafter"`` or ``"colocated"``; set by the caller."""
    sm_mhz: float | None = None
    """SM clock now (NVML), MHz."""
    max_sm_mhz: float | None = None
    """The device's maximum SM clock (NVML), MHz."""
    power_w: float | None = None
    """Power draw now (NVML), W."""
    clock_reasons: list[str] | None = None
    """What holds the clock back now (NVML's clock-event reasons, idle left out): [] for nothing."""
    mem_allocated_gib: float | None = None
    """This process's allocator: its peak allocated since preflight (``torch.cuda.max_memory_allocated``), GiB."""
    mem_budget_gib: float | None = None
    """The card this process may use in all (``--gpu-memory-gib``), GiB; None: the whole device."""
    alloc_retries: int | None = None
    """This process's allocator: how often it freed its cached blocks and retried an allocation, since the process
    began (``num_alloc_retries``); each retry waits for the device to finish its work."""

    def to_record(self) -> dict[str, Any]:
        """The metrics.jsonl entry: ``{rank, role, name, mem_used_gib, mem_total_gib, mem_allocated_gib,
        mem_budget_gib, alloc_retries, util, sm_mhz, max_sm_mhz, power_w, clock_reasons}``."""
        record = asdict(self)
        return {key: record[key] for key in RECORD_KEYS}

    def memory_text(self) -> str:
        """E.g. "92.3/94.97 GiB card, 88.1 allocated, 14 retries": the device's use of its card (or of the device),
        the allocator's peak, and its retries where it had any."""
        if self.mem_used_gib is None or self.mem_total_gib is None:
            return "n/a"
        of = (f"{self.mem_budget_gib:.2f} GiB card" if self.mem_budget_gib is not None
              else f"{self.mem_total_gib:.1f} GiB")
        allocated = f", {self.mem_allocated_gib:.1f} allocated" if self.mem_allocated_gib is not None else ""
        retries = (f", {self.alloc_retries:,} retr{'y' if self.alloc_retries == 1 else 'ies'}"
                   if self.alloc_retries else "")
        return f"{self.mem_used_gib:.1f}/{of}{allocated}{retries}"

    def util_text(self) -> str:
        return "n/a" if self.util is None else f"{self.util:.0%}"

    def clock_text(self) -> str:
        """E.g. "1,755/1,980 MHz, power cap" (held back) or "1,980/1,980 MHz"."""
        if self.sm_mhz is None:
            return "n/a"
        text = f"{self.sm_mhz:,.0f}" + (f"/{self.max_sm_mhz:,.0f}" if self.max_sm_mhz else "") + " MHz"
        return text + (", " + ", ".join(self.clock_reasons) if self.clock_reasons else "")


RECORD_KEYS = ("rank", "role", "name", "mem_used_gib", "mem_total_gib", "mem_allocated_gib", "mem_budget_gib",
               "alloc_retries", "util", "sm_mhz", "max_sm_mhz", "power_w", "clock_reasons")

# NVML's clock-event ("throttle") reason bits, as nvml.h numbers them.
CLOCK_REASONS = {
    0x1: "idle",
    0x2: "application clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
    0x100: "display clocks",
}


def reason_names(bits: int) -> list[str]:
    """The names of NVML clock-event reason ``bits``, idle left out."""
    return [name for bit, name in CLOCK_REASONS.items() if bit != 0x1 and bits & bit]


@dataclass
class ClockReading:
    sm_mhz: float
    power_w: float | None
    temperature_c: float | None
    reasons: int
    """NVML's clock-event reason bits at that moment (0: running at the clock it asked for)."""


def read_clock(nvml: Any, handle: Any) -> ClockReading:
    """SM clock, power, temperature and clock-event reasons of one NVML device (raises if the clock is unreadable)."""
    sm = float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
    try:
        power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    except Exception:
        power = None
    try:
        temperature = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    except Exception:
        temperature = None
    reasons_of = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    try:
        reasons = int(reasons_of(handle)) if reasons_of else 0
    except Exception:
        reasons = 0
    return ClockReading(sm, power, temperature, reasons)


# NVML state: None = not tried yet, False = unavailable, else the imported module.
_nvml: Any = None


def nvml_module() -> Any:
    """The initialised ``pynvml`` module, or None where it is not installed or NVML fails (tried once)."""
    global _nvml
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:  # not installed, no driver, or an NVML error: fall back quietly
            _nvml = False
    return _nvml or None


def nvml_handle(nvml: Any, index: int) -> Any:
    """NVML's handle for torch device ``index``.

    NVML numbers all of the host's GPUs while torch numbers the ones CUDA_VISIBLE_DEVICES shows,
    so match by UUID, then by PCI address; the bare index only when nothing is hidden.
    """
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        address = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(address)
        except Exception:
            pass
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    return None


def nvml_memory(nvml: Any, handle: Any) -> tuple[float, float]:
    """(used, total) bytes of one NVML device as CUDA counts them: the driver's reserved memory left out of both
    (NVML's second memory call reports it apart; the first counts it as used, and is the fallback)."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return float(memory.used), float(memory.total - memory.reserved)
        except Exception:  # an older driver: the first call
            pass
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return float(memory.used), float(memory.total)


def _nvml_stats(index: int, name: str) -> GpuStats | None:
    nvml = nvml_module()
    if nvml is None:
        return None
    try:
        handle = nvml_handle(nvml, index)
        if handle is None:
            return None
        used, total = nvml_memory(nvml, handle)
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        stats = GpuStats(name, used / _GIB, total / _GIB, util)
    except Exception:
        return None
    try:  # the clock is extra: a device that does not report it keeps its memory figures
        clock = read_clock(nvml, handle)
        stats.sm_mhz, stats.power_w, stats.clock_reasons = clock.sm_mhz, clock.power_w, reason_names(clock.reasons)
        stats.max_sm_mhz = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
    except Exception:
        pass
    return stats


def cuda_index(device: torch.device | str | int) -> int | None:
    """Torch's index of ``device`` (an int is an index), None for a CPU device or without CUDA."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_stats(device: torch.device | str | int) -> GpuStats:
    """Stats of one torch device (a rank's own). CPU, or any failure, gives None fields ("n/a")."""
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = cuda_index(device)
        if index is None:
            return GpuStats(name=device.type)
        name = torch.cuda.get_device_name(index)
        stats = _nvml_stats(index, name)
        if stats is None:
            # mem_get_info creates a CUDA context on the device: fine for the rank's own device only.
            free, total = torch.cuda.mem_get_info(index)
            stats = GpuStats(name, (total - free) / _GIB, total / _GIB, None)
        stats.mem_allocated_gib = torch.cuda.max_memory_allocated(index) / _GIB
        stats.alloc_retries = int(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))
        budget = device_budget(index)
        stats.mem_budget_gib = None if budget is None else budget / _GIB
        return stats
    except Exception:
        return GpuStats(name=str(device))


def local_gpu_stats() -> list[GpuStats]:
    """Stats of every GPU this process sees; empty without CUDA.

    Without NVML only the current device has memory figures: asking another device through
    torch would create a CUDA context (hundreds of MiB) on it.
    """
    try:
        if not torch.cuda.is_available():
            return []
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        stats = []
        for index in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(index)
            found = _nvml_stats(index, name)
            if found is None:
                found = device_stats(index) if index == current else GpuStats(name)
            stats.append(found)
        return stats
    except Exception:
        return []
