"""The peak MFU is quoted against, the measured matmul ceiling beside it, and GPU specs by name.

MFU is quoted against the GPU's spec dense bf16 peak, as the field does (torchtitan, Megatron,
the peers' papers), so that figures compare across projects. Beside it the monitor shows the
share of the matmul rate this GPU actually reaches (an 8192^3 bf16 product), the ceiling no
real workload passes: on the development H200, 788 of the 989 TFLOP/s of its spec. A GPU
without a spec entry is quoted against its measured rate (and says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet numbers that planning and MFU need."""

    name: str
    bf16_flops: float
    """Dense (no sparsity) bf16 tensor-core FLOP/s."""
    memory_gib: float
    """Memory of one GPU as sold (GB on the datasheet, about GiB as torch reports it)."""
    link_gbs: float = 40.0
    """A collective's bandwidth between the GPUs of one node (NCCL bus bandwidth, GB/s): an assumption from
    the interconnect (NVLink generation, or PCIe 5 x16 for cards without NVLink), for planning only."""


# Matched by substring of the lower-cased torch device name, first match first: more specific
# entries (an H100's PCIe variant) before the general one. Dense bf16 = half the datasheet's
# "with sparsity" figure. RTX PRO 6000 Blackwell: 4 PFLOPS FP4 with sparsity -> 504 TFLOP/s dense
# bf16 (its spec sheets list 503.8); the Max-Q edition runs lower clocks and has no entry.
_SPECS = (
    ("h200 nvl", GpuSpec("NVIDIA H200 NVL", 835e12, 141, 40.0)),
    ("h200", GpuSpec("NVIDIA H200", 989e12, 141, 360.0)),
    ("h100 pcie", GpuSpec("NVIDIA H100 PCIe", 756e12, 80, 40.0)),
    ("h100", GpuSpec("NVIDIA H100 SXM", 989e12, 80, 360.0)),
    ("a100", GpuSpec("NVIDIA A100", 312e12, 80, 230.0)),
    ("b200", GpuSpec("NVIDIA B200", 2250e12, 180, 700.0)),
    ("rtx pro 6000 blackwell max-q", None),
    ("rtx pro 6000", GpuSpec("NVIDIA RTX PRO 6000 Blackwell", 504e12, 96, 40.0)),
)

# Matmul ceilings measured with ``measure_peak_flops``'s method, by exact torch device name.
_MEASURED = {
    "nvidia h200": (788e12, "measured: development H200, 8192^3 bf16 matmul, torch 2.11"),
}


def gpu_spec(name: str) -> GpuSpec | None:
    """The spec of a GPU by (part of) its name, e.g. "NVIDIA H200", "H100", "RTX PRO 6000"; None if unknown."""
    key = name.strip().lower()
    for pattern, spec in _SPECS:
        if pattern in key:
            return spec
    return None


def known_gpus() -> list[GpuSpec]:
    return [spec for _, spec in _SPECS if spec is not None]


@dataclass(frozen=True)
class PeakFlops:
    """What MFU is measured against (``flops``), and the measured matmul ceiling beside it."""

    flops: float
    """FLOP/s of one device MFU is quoted against: the spec dense bf16 peak when known."""
    source: str
    """Why this number: spec of a known GPU, measured here, or given by the user."""
    ceiling: float | None = None
    """The measured dense matmul rate of one device (the second MFU figure), if known."""
    for_mfu: bool = True
    """Whether MFU is quoted against ``flops``. Not for a CPU's measured rate: it moves several-fold
    between runs on one machine with its load and threads (docs/benchmarks/2026-12-cpu-mfu-peak.md), so an MFU against it
    would say more about the measurement than about the run."""

    def describe(self) -> str:
        if not self.for_mfu:
            return f"no MFU: {self.source}"
        text = f"peak {format_flops(self.flops)}/s per device ({self.source})"
        if self.ceiling and self.ceiling != self.flops:
            text += f"; matmul ceiling {format_flops(self.ceiling)}/s"
        return text

    def of_ceiling(self, utilisation: float) -> float:
        """An MFU against ``flops`` restated against the ceiling (NaN without one)."""
        return utilisation * self.flops / self.ceiling if self.ceiling else float("nan")


def format_flops(flops: float) -> str:
    """``788e12`` -> ``"788 TFLOP"``; small numbers in GFLOP so a CPU run reads sensibly."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP"


def known_peak(device_name: str) -> PeakFlops | None:
    """The spec peak (with the measured ceiling when known) of a GPU by its torch name, or None."""
    spec = gpu_spec(device_name)
    if spec is None:
        return None
    measured = _MEASURED.get(device_name.strip().lower())
    return PeakFlops(spec.bf16_flops, f"spec dense bf16, {spec.name}", measured[0] if measured else None)


def mfu(flops: float, seconds: float, peak_flops: float, num_gpus: int = 1) -> float:
    """Model-FLOP utilisation: counted FLOPs / (wall seconds x peak x GPUs); NaN before any time."""
    if peak_flops <= 0 or num_gpus < 1:
        raise ValueError(f"peak_flops must be positive and num_gpus >= 1, got {peak_flops} and {num_gpus}")
    if seconds <= 0:
        return float("nan")
    return flops / (seconds * peak_flops * num_gpus)


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype | None = None) -> float:
    """Dense matrix-multiply FLOP/s of ``device``.

    CUDA: 8192^3 products in ``dtype`` (bf16 by default), 3 warm-ups, then the median of 5 windows
    of 10 products timed with CUDA events (about a second on an H200). CPU: 512^3 fp32 products
    for about 0.2 s, enough for an order of magnitude, which is all a CPU run needs.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(device, dtype or torch.bfloat16)
    return _measure_cpu(dtype or torch.float32)


def _measure_cuda(device: torch.device, dtype: torch.dtype, size: int = 8192) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    with torch.cuda.device(device):
        for _ in range(3):  # clocks ramp up and cuBLAS picks its kernel here
            torch.mm(a, b, out=out)
        rates = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            rates.append(10 * 2 * size**3 / (start.elapsed_time(end) / 1e3))
    return sorted(rates)[len(rates) // 2]


def _measure_cpu(dtype: torch.dtype, size: int = 512, budget_s: float = 0.3) -> float:
    """The best of several short windows: a busy machine slows some windows, never speeds one up."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool start
    best, deadline = 0.0, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def resolve_peak(device: torch.device | str, dtype: torch.dtype | None = None,
                 override_flops: float | None = None) -> PeakFlops:
    """The peak the monitor uses: the user's number, else the GPU's spec (its ceiling measured here
    when not known), else the rate measured here."""
    if override_flops is not None:
        if override_flops <= 0:
            raise ValueError(f"the peak must be positive FLOP/s, got {override_flops}")
        return PeakFlops(float(override_flops), "given by the user")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dtype = dtype or torch.bfloat16
        known = known_peak(name)
        if known is not None and known.ceiling is not None:
            return known
        measured = _measure_cuda(device, dtype)
        if known is not None:
            return PeakFlops(known.flops, known.source, measured)
        return PeakFlops(measured, f"measured here: {name} has no spec entry, 8192^3 {_dtype_name(dtype)} matmul",
                         measured)
    dtype = dtype or torch.float32
    rate = _measure_cpu(dtype)  # an order of magnitude, for planning; too unsteady to quote MFU against
    return PeakFlops(rate, f"a CPU's matmul rate ({format_flops(rate)}/s measured here, 512^3 {_dtype_name(dtype)}) "
                           "varies several-fold between runs; --peak-tflops sets a peak to quote MFU against",
                     rate, for_mfu=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
