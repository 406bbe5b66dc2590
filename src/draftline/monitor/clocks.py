"""What the GPU's clock did while something was timed: SM clock, power, temperature, and the reasons
NVML gives for holding the clock back (power cap, heat, ...), sampled in a thread.

The same code runs a step at different speeds on machines of one kind, and on one machine from one
minute to the next; a timing with these figures beside it says whether the clock moved. NVML comes
from the optional ``nvidia-ml-py`` package (``pynvml``); without it, or on CPU, a watch records
nothing and says "n/a". Nothing here raises into the timed code.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from draftline.monitor.gpu import CLOCK_REASONS, ClockReading, cuda_index, nvml_handle, nvml_module, read_clock, reason_names


@dataclass
class ClockSummary:
    """The samples of one watched span; figures are None where NVML did not give them."""

    samples: list[ClockReading] = field(default_factory=list)
    max_sm_mhz: float | None = None
    """The device's maximum SM clock (NVML), for scale."""

    def sm_median(self) -> float | None:
        return statistics.median(s.sm_mhz for s in self.samples) if self.samples else None

    def reason_shares(self) -> dict[str, float]:
        """Share of the samples in which each reason held the clock back (idle left out), in NVML's order."""
        hits = Counter(name for s in self.samples for name in reason_names(s.reasons))
        return {name: hits[name] / len(self.samples) for name in CLOCK_REASONS.values() if hits[name]}

    def to_record(self) -> dict[str, Any]:
        if not self.samples:
            return {"clock_samples": 0}
        powers = [s.power_w for s in self.samples if s.power_w is not None]
        temps = [s.temperature_c for s in self.samples if s.temperature_c is not None]
        return {
            "clock_samples": len(self.samples),
            "sm_mhz_median": self.sm_median(),
            "sm_mhz_min": min(s.sm_mhz for s in self.samples),
            "sm_mhz_max_device": self.max_sm_mhz,
            "power_w_median": statistics.median(powers) if powers else None,
            "temperature_c_max": max(temps) if temps else None,
            "clock_reasons": self.reason_shares(),
        }

    def text(self) -> str:
        """One line, e.g. "SM 1,755 MHz median (min 1,620; max 1,980); 690 W; 78 C; held back by power cap 60%"."""
        if not self.samples:
            return "clock n/a"
        record = self.to_record()
        parts = [f"SM {record['sm_mhz_median']:,.0f} MHz median (min {record['sm_mhz_min']:,.0f}"
                 + (f"; max {self.max_sm_mhz:,.0f})" if self.max_sm_mhz else ")")]
        if record["power_w_median"] is not None:
            parts.append(f"{record['power_w_median']:.0f} W")
        if record["temperature_c_max"] is not None:
            parts.append(f"{record['temperature_c_max']:.0f} C")
        reasons = record["clock_reasons"]
        parts.append("held back by " + ", ".join(f"{k} {v:.0%}" for k, v in reasons.items()) if reasons
                     else "not held back")
        return "; ".join(parts)


class ClockWatch:
    """Samples ``device``'s clock every ``period_s`` between ``start()`` and ``stop()`` (also as a
    context manager; the summary is then ``watch.summary``).

    The thread only reads NVML (no CUDA call), so it neither syncs nor slows the GPU work it watches.
    """

    def __init__(self, device: torch.device | str | int, period_s: float = 0.1):
        self.period_s = period_s
        self.summary = ClockSummary()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        nvml = handle = None
        try:
            index = cuda_index(device)
            nvml = nvml_module() if index is not None else None
            handle = nvml_handle(nvml, index) if nvml is not None else None
        except Exception:
            handle = None
        self._attach(nvml, handle)

    @classmethod
    def of_handle(cls, nvml: Any, handle: Any, period_s: float = 0.1) -> ClockWatch:
        """A watch on an NVML handle given directly (tests, or a device torch does not see)."""
        watch = cls("cpu", period_s)
        watch._attach(nvml, handle)
        return watch

    def _attach(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = (nvml, handle) if handle is not None else (None, None)
        if handle is not None:
            try:
                self.summary.max_sm_mhz = float(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
            except Exception:
                pass

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _run(self) -> None:
        while True:
            try:
                self.summary.samples.append(read_clock(self._nvml, self._handle))
            except Exception:
                pass
            if self._stop.wait(self.period_s):
                return

    def start(self) -> ClockWatch:
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="draftline-clock-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> ClockSummary:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.summary

    def __enter__(self) -> ClockWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
