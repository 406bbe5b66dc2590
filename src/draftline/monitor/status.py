"""One status snapshot of the training line, and the meters that produce its rates.

``LineStatus`` holds exactly what the dashboard shows and what a ``kind: "train"`` record of
``metrics.jsonl`` carries (docs/ARCHITECTURE.md). The trainer fills it every monitor interval from
host-side values only; building one never touches the GPU.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from draftline.monitor.gpu import GpuStats
from draftline.sizing.peak import PeakFlops

_NaN = float("nan")


@dataclass
class LineStatus:
    """The training line at one moment. Rates are over the monitor's recent window."""

    step: int = 0
    """Optimizer steps done."""
    total_steps: int | None = None
    """Optimizer steps the run will take (None if unknown)."""
    epoch: int = 0
    """Epoch the drafters are training on (0-based; the last one once the run is through)."""
    num_epochs: int | None = None
    """Epochs of the run."""
    epochs_done: float = 0.0
    """Epochs trained so far, fractions included: 2.0 when a 2-epoch run is through."""
    samples: int = 0
    """Samples (documents) trained on so far."""
    tokens: int = 0
    """Tokens trained on so far."""

    loss: float = _NaN
    """Mean weighted loss over the window."""
    accuracy: float = _NaN
    """Top-1 accuracy over all labelled slots."""
    accuracy_by_position: list[float] = field(default_factory=list)
    """Top-1 accuracy of block slots 1..B-1."""
    tau: float = _NaN
    """Measured acceptance length: speculative decoding of held-out prompts by the drafter, at the
    latest evaluation (``--eval-every``); NaN before the first."""
    tau_step: int | None = None
    """The step ``tau`` was measured at."""
    tf_acceptance: float = _NaN
    """Teacher-forced acceptance of the training blocks (uniformly drawn anchors) over the window:
    what a greedy verifier would accept if blocks started at random positions. Decoding starts
    them after rejections, so this reads well above ``tau``; use it for trends only."""
    lr: float = _NaN
    """Learning rate of the last step."""
    grad_norm: float = _NaN
    """Gradient norm before clipping, last step."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or gradient, whole run."""

    ktok_s: float = _NaN
    """Thousands of tokens per second consumed by the drafters."""
    samples_s: float = _NaN
    """Samples per second consumed by the drafters."""
    tflops: float = _NaN
    """Counted model TFLOP/s of the whole line (targets + drafters), per docs/FLOPS.md."""
    mfu: float = _NaN
    """``tflops`` over the spec peak of all GPUs in the line, 0..1 (``mfu_ceiling``: over the measured matmul rate)."""

    q_pre: list[int] = field(default_factory=list)
    """Ready token batches in each target's prefetch queue."""
    q_hs: int = 0
    """Hidden-state batches waiting for a drafter."""
    target_wait: float = _NaN
    """Fraction of wall time the targets spent waiting (on data or on a full q_hs)."""
    drafter_wait: float = _NaN
    """Fraction of wall time the drafters spent waiting on an empty q_hs."""
    target_batches_s: float = _NaN
    """Batches per second produced by all targets."""
    drafter_batches_s: float = _NaN
    """Batches per second consumed by all drafters."""
    eta_s: float | None = None
    """Seconds to the last step at the recent rate."""
    compile_s: float = 0.0
    """Seconds the line's processes have spent compiling (``torch.compile``, and Triton's kernels of libraries outside
    it: ``compile_clock``) since they started, summed over the ranks; preflight's warm-up included."""
    compiling_s: float = 0.0
    """Of ``compile_s``, the seconds since the status before: a window whose rates fell while this is high was
    compiling for a new shape (or new kernel arguments), not running slowly."""
    gpus: list[GpuStats] = field(default_factory=list)
    """Memory and utilisation of each GPU of the line (none for CPU ranks)."""
    num_targets: int | None = None
    """Ranks running the target (None until they report)."""
    num_drafters: int | None = None
    """Ranks training the drafter (None until they report)."""
    colocated: bool = False
    """Each rank runs a target and a drafter (one process, or --colocated): no split to rebalance."""
    cpu_cores: int | None = None
    """CPU ranks: the cores of the host they share (None on GPUs, where each rank has its own device)."""
    target_parallel: int = 1
    """Ranks per target group (--target-parallel): a split moves target ranks by whole groups."""

    time: float = field(default_factory=time.time)
    """Unix time of the snapshot."""
    elapsed_s: float = 0.0
    """Seconds since the run (this start of it) began."""

    extras: dict[str, Any] = field(default_factory=dict)
    """The training method's own figures over the window, as its objective summarises them (DSpark: ``ce``,
    ``l1``, ``confidence_bce``, ``confidence_abs_error``, ``tau_expected``, ``confidence_by_position``,
    ``expected_acceptance_by_position``); none for DFlash."""

    # Display only: not part of the metrics record.
    q_pre_capacity: int | None = None
    """Capacity of each prefetch queue."""
    q_hs_capacity: int | None = None
    """Capacity of the hidden-state queue."""
    peak: PeakFlops | None = None
    """The per-GPU peak MFU is measured against, with its source."""

    @property
    def mfu_ceiling(self) -> float:
        """``mfu`` against the measured matmul ceiling instead of the spec peak (NaN if unknown)."""
        return self.peak.of_ceiling(self.mfu) if self.peak is not None else float("nan")

    def to_record(self) -> dict[str, Any]:
        """The ``kind: "train"`` line of metrics.jsonl."""
        return {
            "kind": "train",
            "time": self.time,
            "elapsed_s": self.elapsed_s,
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.epoch,
            "num_epochs": self.num_epochs,
            "epochs_done": self.epochs_done,
            "samples": self.samples,
            "tokens": self.tokens,
            "loss": self.loss,
            "accuracy": self.accuracy,
            "accuracy_by_position": list(self.accuracy_by_position),
            "tau": self.tau,
            "tau_step": self.tau_step,
            "tf_acceptance": self.tf_acceptance,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "skipped_steps": self.skipped_steps,
            "ktok_s": self.ktok_s,
            "samples_s": self.samples_s,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "mfu_ceiling": self.mfu_ceiling,
            "q_pre": list(self.q_pre),
            "q_hs": self.q_hs,
            "q_hs_capacity": self.q_hs_capacity,
            "target_wait": self.target_wait,
            "drafter_wait": self.drafter_wait,
            "target_batches_s": self.target_batches_s,
            "drafter_batches_s": self.drafter_batches_s,
            "eta_s": self.eta_s,
            "compile_s": self.compile_s,
            "compiling_s": self.compiling_s,
            "gpus": [gpu.to_record() for gpu in self.gpus],
            "layout": {"targets": self.num_targets, "drafters": self.num_drafters, "colocated": self.colocated},
            **self.extras,
        }


class RateMeter:
    """Amount per second over the last ``window_s`` seconds (tokens, samples, batches, steps).

    Feeding it seconds spent waiting gives the waiting fraction: waited seconds per wall second.

    Amounts arrive in lumps (a step's tokens when the step ends), so a window that ended at "now" would miss the
    part of the current lump already produced: between two lumps T seconds apart it would read low by up to
    T / window_s, half that on average (4% for 2.4 s steps in a 30 s window). The window therefore ends at the
    last amount while "now" is within one usual interval of it (the mean interval between the amounts in the
    window), and moves on with "now" after that, so a stalled producer's rate falls to zero instead of freezing.
    """

    def __init__(self, window_s: float = 30.0, now: float | None = None):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.total = 0.0
        self._points: deque[tuple[float, float]] = deque([(self._now(now), 0.0)])
        self._interval = 0.0  # the mean interval between the amounts in the window, as of the last one

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def add(self, amount: float, now: float | None = None) -> None:
        now = self._now(now)
        self.total += amount
        self._points.append((now, self.total))
        self._prune(now)
        self._interval = (now - self._points[0][0]) / (len(self._points) - 1)

    def _prune(self, end: float) -> None:
        # Keep one point at or before the window's start so the window stays fully covered.
        start = end - self.window_s
        while len(self._points) > 1 and self._points[1][0] <= start:
            self._points.popleft()

    def rate(self, now: float | None = None) -> float:
        """Amount per second over the window (or since the meter began); NaN at t=0."""
        now = self._now(now)
        end = max(self._points[-1][0], now - self._interval)  # now, before any amount (interval 0)
        self._prune(end)
        first_time, first_total = self._points[0]
        start = max(first_time, end - self.window_s)
        if end <= start:
            return _NaN
        if first_time < start:
            # The oldest point lies before the window: interpolate the total at the window's start.
            next_time, next_total = self._points[1] if len(self._points) > 1 else (end, self.total)
            share = (start - first_time) / (next_time - first_time) if next_time > first_time else 1.0
            first_total += share * (next_total - first_total)
        return (self.total - first_total) / (end - start)


def eta_seconds(steps_done: int, total_steps: int | None, steps_per_s: float, *,
                ends_at: float | None = None) -> float | None:
    """Seconds to ``total_steps`` at ``steps_per_s``, or to ``ends_at`` (a time limit, Unix time) where that
    comes first; None when it cannot be known yet."""
    left = None if ends_at is None else max(0.0, ends_at - time.time())
    if total_steps is None or not math.isfinite(steps_per_s) or steps_per_s <= 0:
        return left
    by_steps = max(0, total_steps - steps_done) / steps_per_s
    return by_steps if left is None else min(by_steps, left)


def format_duration(seconds: float | None) -> str:
    """``3725`` -> ``"1h02m"``; ``None`` -> ``"n/a"``."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"
