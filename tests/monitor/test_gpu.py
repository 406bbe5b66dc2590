"""GPU stats never raise; on CPU they read "n/a"."""

from __future__ import annotations

import pytest
import torch

from draftline.monitor.gpu import GpuStats, device_stats, local_gpu_stats


def test_cpu_device_gives_n_a():
    stats = device_stats("cpu")
    assert stats.name == "cpu"
    assert stats.memory_text() == "n/a" and stats.util_text() == "n/a"
    assert stats.to_record() == {"rank": None, "role": None, "name": "cpu", "mem_used_gib": None,
                                 "mem_total_gib": None, "util": None}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without GPUs")
def test_no_gpu_machine():
    assert local_gpu_stats() == []
    assert device_stats("cuda").memory_text() == "n/a"  # asked for CUDA where there is none: no raise
    assert device_stats(0).util_text() == "n/a"


def test_formatting():
    stats = GpuStats("NVIDIA H200", 61.24, 139.8, 0.973)
    assert stats.memory_text() == "61.2/139.8 GiB" and stats.util_text() == "97%"


@pytest.mark.gpu
def test_cuda_device_has_memory():
    stats = device_stats(torch.device("cuda", 0))
    assert stats.mem_total_gib and stats.mem_total_gib > 1
    assert len(local_gpu_stats()) == torch.cuda.device_count()
