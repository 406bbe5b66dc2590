"""The clock watch: samples NVML in a thread, summarises, says "n/a" without NVML or on CPU."""

from __future__ import annotations

import time

import pytest
import torch

from draftline.monitor.clocks import ClockSummary, ClockWatch
from draftline.monitor.gpu import ClockReading


class FakeNvml:
    """The few NVML calls the watch makes, answering from a script of (MHz, mW, C, reasons)."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    def _now(self):
        return self.script[min(self.calls, len(self.script) - 1)]

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        assert handle == "gpu0" and kind == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._now()[0]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._now()[1]

    def nvmlDeviceGetTemperature(self, handle, kind):
        return self._now()[2]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        reasons = self._now()[3]
        self.calls += 1  # the last call of one sample
        return reasons


def test_watch_samples_and_summarises_power_capping():
    nvml = FakeNvml([(1980, 600_000, 60, 0), (1755, 700_000, 70, 0x4), (1620, 700_000, 75, 0x4 | 0x20)])
    with ClockWatch.of_handle(nvml, "gpu0", period_s=0.005) as watch:
        deadline = time.monotonic() + 5
        while nvml.calls < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
    summary = watch.summary
    assert len(summary.samples) >= 6 and summary.max_sm_mhz == 1980
    record = summary.to_record()
    assert record["sm_mhz_min"] == 1620 and record["sm_mhz_median"] == 1620  # most samples at the last entry
    assert record["power_w_median"] == 700 and record["temperature_c_max"] == 75
    shares = record["clock_reasons"]
    assert set(shares) == {"power cap", "thermal (software)"}
    assert shares["power cap"] > shares["thermal (software)"] > 0.5
    text = summary.text()
    assert text.startswith("SM 1,620 MHz median (min 1,620; max 1,980); 700 W; 75 C; held back by power cap")


def test_summary_not_held_back_and_idle_left_out():
    summary = ClockSummary([ClockReading(1980, 500.0, 50, 0x1), ClockReading(1980, 510.0, 51, 0)], max_sm_mhz=1980)
    assert summary.reason_shares() == {}
    assert summary.text().endswith("not held back")


def test_old_nvml_throttle_name_and_missing_power():
    class OldNvml(FakeNvml):
        nvmlDeviceGetCurrentClocksThrottleReasons = FakeNvml.nvmlDeviceGetCurrentClocksEventReasons

        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("not supported")

    OldNvml.nvmlDeviceGetCurrentClocksEventReasons = None
    nvml = OldNvml([(1500, 0, 40, 0x8)])
    watch = ClockWatch.of_handle(nvml, "gpu0", period_s=0.001).start()
    deadline = time.monotonic() + 5
    while not watch.summary.samples and time.monotonic() < deadline:
        time.sleep(0.002)
    summary = watch.stop()
    assert summary.samples[0] == ClockReading(1500.0, None, 40.0, 0x8)
    assert summary.to_record()["power_w_median"] is None
    assert "hardware slowdown 100%" in summary.text() and " W;" not in summary.text()


def test_cpu_watch_records_nothing():
    with ClockWatch("cpu") as watch:
        pass
    assert not watch.available
    assert watch.summary.text() == "clock n/a" and watch.summary.to_record() == {"clock_samples": 0}


@pytest.mark.gpu
def test_cuda_watch_reads_the_clock():
    pytest.importorskip("pynvml")
    with ClockWatch(torch.device("cuda", 0), period_s=0.02) as watch:
        time.sleep(0.2)
    assert watch.available and watch.summary.samples
    assert 0 < watch.summary.sm_median() <= watch.summary.max_sm_mhz
