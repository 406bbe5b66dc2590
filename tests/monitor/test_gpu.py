"""GPU stats never raise; on CPU they read "n/a"."""

from __future__ import annotations

import pytest
import torch

import draftline.monitor.gpu as gpu_module
from draftline.monitor.gpu import GpuStats, device_stats, local_gpu_stats, reason_names


def test_cpu_device_gives_n_a():
    stats = device_stats("cpu")
    assert stats.name == "cpu"
    assert stats.memory_text() == "n/a" and stats.util_text() == "n/a"
    assert stats.to_record() == {"rank": None, "role": None, "name": "cpu", "mem_used_gib": None,
                                 "mem_total_gib": None, "mem_allocated_gib": None, "mem_budget_gib": None,
                                 "alloc_retries": None, "util": None, "sm_mhz": None, "max_sm_mhz": None,
                                 "power_w": None, "clock_reasons": None}
    assert stats.clock_text() == "n/a"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without GPUs")
def test_no_gpu_machine():
    assert local_gpu_stats() == []
    assert device_stats("cuda").memory_text() == "n/a"  # asked for CUDA where there is none: no raise
    assert device_stats(0).util_text() == "n/a"


def test_formatting():
    stats = GpuStats("NVIDIA H200", 61.24, 139.8, 0.973)
    assert stats.memory_text() == "61.2/139.8 GiB" and stats.util_text() == "97%"
    stats.sm_mhz, stats.max_sm_mhz, stats.clock_reasons = 1755.0, 1980.0, ["power cap"]
    assert stats.clock_text() == "1,755/1,980 MHz, power cap"
    stats.sm_mhz, stats.clock_reasons = 1980.0, []
    assert stats.clock_text() == "1,980/1,980 MHz"
    assert GpuStats(**stats.to_record()).clock_text() == "1,980/1,980 MHz"  # a peer's record rebuilds it
    # the allocator's peak beside the device's use; with --gpu-memory-gib, the device's use of that card
    stats.mem_allocated_gib = 55.04
    assert stats.memory_text() == "61.2/139.8 GiB, 55.0 allocated"
    stats.mem_budget_gib = 94.97
    assert stats.memory_text() == "61.2/94.97 GiB card, 55.0 allocated"
    # an allocator that had to free its cache and retry says so (none: nothing added)
    stats.alloc_retries = 0
    assert stats.memory_text() == "61.2/94.97 GiB card, 55.0 allocated"
    stats.alloc_retries, one = 1_204, GpuStats(**(stats.to_record() | {"alloc_retries": 1}))
    assert stats.memory_text() == "61.2/94.97 GiB card, 55.0 allocated, 1,204 retries"
    assert one.memory_text() == "61.2/94.97 GiB card, 55.0 allocated, 1 retry"


def test_reason_names_leave_idle_out():
    assert reason_names(0x1) == []
    assert reason_names(0x1 | 0x4 | 0x40) == ["power cap", "thermal (hardware)"]


class _Memory:
    used, total = 61 * 2**30, 140 * 2**30


class _MemoryV2:  # NVML's second call: the driver's reserve apart
    used, total, reserved = 61 * 2**30, 140.4 * 2**30, 0.6 * 2**30


class _Util:
    gpu = 97


class FakeNvml:
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def __init__(self, clock_fails=False, v2=False):
        self.clock_fails = clock_fails
        if v2:
            self.nvmlMemory_v2 = 0x2000028

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        return _MemoryV2() if version == getattr(self, "nvmlMemory_v2", None) and version else _Memory()

    def nvmlDeviceGetUtilizationRates(self, handle):
        return _Util()

    def nvmlDeviceGetClockInfo(self, handle, kind):
        if self.clock_fails:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1620

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return 1980

    def nvmlDeviceGetPowerUsage(self, handle):
        return 699_500

    def nvmlDeviceGetTemperature(self, handle, kind):
        return 80

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4 | 0x20


@pytest.mark.parametrize("clock_fails", [False, True])
def test_nvml_stats_carry_the_clock(monkeypatch, clock_fails):
    monkeypatch.setattr(gpu_module, "nvml_module", lambda: FakeNvml(clock_fails))
    monkeypatch.setattr(gpu_module, "nvml_handle", lambda nvml, index: "gpu0")
    stats = gpu_module._nvml_stats(0, "NVIDIA H200")
    assert stats.memory_text() == "61.0/140.0 GiB" and stats.util_text() == "97%"  # memory stays either way
    if clock_fails:
        assert stats.clock_text() == "n/a"
    else:
        assert stats.clock_text() == "1,620/1,980 MHz, power cap, thermal (software)"
        assert stats.to_record()["power_w"] == 699.5


def test_nvml_memory_as_cuda_counts_it(monkeypatch):
    """Where NVML reports the driver's reserve apart (its second call), it is left out of the used and the total
    figures, as cudaMemGetInfo and torch's capacity leave it out; the first call is the fallback."""
    monkeypatch.setattr(gpu_module, "nvml_module", lambda: FakeNvml(v2=True))
    monkeypatch.setattr(gpu_module, "nvml_handle", lambda nvml, index: "gpu0")
    assert gpu_module._nvml_stats(0, "NVIDIA H200").memory_text() == "61.0/139.8 GiB"
    assert gpu_module.nvml_memory(FakeNvml(), "gpu0") == (61 * 2**30, 140 * 2**30)


@pytest.mark.gpu
def test_cuda_device_has_memory():
    stats = device_stats(torch.device("cuda", 0))
    assert stats.mem_total_gib and stats.mem_total_gib > 1
    assert len(local_gpu_stats()) == torch.cuda.device_count()
    assert isinstance(stats.alloc_retries, int) and stats.alloc_retries >= 0  # the rank's own allocator is read
    if gpu_module.nvml_module() is not None:  # nvidia-ml-py installed: the clock is read too
        assert 0 < stats.sm_mhz <= stats.max_sm_mhz and isinstance(stats.clock_reasons, list)
