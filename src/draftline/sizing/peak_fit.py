"""Preflight's measurements and their fit: peak memory is linear in the tokens and query rows of a pass.

``fit_and_check`` warms up once (kernels, workspaces and the optimizer state are allocated then, and not
carried into the fit's slopes), measures two or three small sizes (``measured_sizes``), fits
``peak = base + per_token * tokens + per_row * rows`` (``LinearPeak``) and checks the fit at one more
size (``check_point``, ``FitCheck``): a fit off by more than ``CHECK_TOLERANCE`` there is not trusted for a
refusal. The fit also answers the largest sizes that fit a limit (``LinearPeak.largest_tokens``,
``largest_rows``), which is what a refusal suggests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from draftline.compile_clock import Took
from draftline.distributed.memory import gib

CHECK_TOLERANCE = (0.25 * 2**30, 0.02)
"""How far the check point's measured peak may be from the fit's prediction: bytes + a share of the peak."""


@dataclass
class LinearPeak:
    """``peak = base + per_token * tokens + per_row * rows``, fitted to measured points."""

    base: float
    per_token: float = 0.0
    per_row: float = 0.0

    def __call__(self, tokens: int, rows: int = 0) -> float:
        return self.base + self.per_token * tokens + self.per_row * rows

    @classmethod
    def fit(cls, points: list[tuple[int, int, float]]) -> "LinearPeak":
        """Least squares over ``(tokens, rows, peak)``; a size that does not vary gets no slope."""
        data = np.asarray(points, dtype=np.float64)
        columns = [np.ones(len(data))]
        varies = [len(set(data[:, i])) > 1 for i in (0, 1)]
        for i in (0, 1):
            if varies[i]:
                columns.append(data[:, i])
        coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), data[:, 2], rcond=None)
        coef = list(coef)
        base = coef.pop(0)
        per_token = max(coef.pop(0), 0.0) if varies[0] else 0.0
        per_row = max(coef.pop(0), 0.0) if varies[1] else 0.0
        return cls(float(base), float(per_token), float(per_row))

    def largest_tokens(self, limit: float, rows: int, multiple: int) -> int:
        """The largest multiple of ``multiple`` tokens whose predicted peak is within ``limit`` (0 if none)."""
        if self.per_token <= 0:
            return 0
        return max(0, int((limit - self.base - self.per_row * rows) / self.per_token) // multiple * multiple)

    def largest_rows(self, limit: float, tokens: int, multiple: int) -> int:
        if self.per_row <= 0:
            return 0
        return max(0, int((limit - self.base - self.per_token * tokens) / self.per_row) // multiple * multiple)


def measured_sizes(full: int, small: int, floor: int) -> list[int]:
    """Measured sizes on one axis: the full size if it is small, else ``small`` and ``2 * small``."""
    if full <= 2 * small:
        return [full]
    return [max(small, floor), max(2 * small, 2 * floor)]


def check_point(tokens: list[int], rows: list[int], row_multiple: int) -> tuple[int, int] | None:
    """A size the fit is checked at, not used to fit it: both axes at their larger size, or on the one
    axis that varies, between its two sizes; None when the configuration is measured directly."""
    if len(tokens) > 1 and len(rows) > 1:
        return tokens[-1], rows[-1]
    if len(tokens) > 1:
        return (tokens[0] + tokens[1]) // 2, rows[0]
    if len(rows) > 1:
        return tokens[0], (rows[0] + rows[1]) // 2 // row_multiple * row_multiple
    return None


@dataclass
class FitCheck:
    """The fit's prediction at the check point against what was measured there."""

    tokens: int
    rows: int
    measured: float
    predicted: float

    @property
    def trusted(self) -> bool:
        absolute, share = CHECK_TOLERANCE
        return abs(self.measured - self.predicted) <= absolute + share * self.measured

    def describe(self) -> str:
        off = self.measured - self.predicted
        size = f"{self.tokens:,} tokens" + (f" x {self.rows:,} rows" if self.rows else "")
        return (f"check at {size}: measured {gib(self.measured)}, the fit says {gib(self.predicted)} "
                f"({'+' if off >= 0 else '-'}{abs(off) / 2**20:,.0f} MiB): "
                + ("the fit holds" if self.trusted else
                   "the fit does not hold (a one-time allocation in a measured point, or a peak not linear in the "
                   "size), so no refusal from it: the configured size is measured"))


def describe_fit(fit: LinearPeak) -> str:
    text = f"fit: {gib(fit.base)} + {fit.per_token * 1024 / 2**20:,.1f} MiB per 1K tokens"
    return text + (f" + {fit.per_row * 1024 / 2**20:,.1f} MiB per 1K query rows" if fit.per_row else "")


def fit_and_check(measured: dict, role: str, run, points_at: list[tuple[int, int]], check_at: tuple[int, int] | None,
                  refuse_oom, say: Callable[[str], None], warmed: Callable[[], None] | None = None):
    """Warm up at the smallest size, measure ``points_at``, fit, check at ``check_at``.

    ``run(tokens, rows, quiet)`` returns the peak (None: out of memory, then ``refuse_oom()`` raises).
    Returns the fit (over every measured point), the check (None without one) and the points; ``say`` tells
    what was measured; ``warmed()`` is called after the warm-up (the kernels loaded, the workspaces made)."""
    took = Took()
    before = float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0
    warm = run(*points_at[0], quiet=True)
    if warm is None:
        refuse_oom()
    kept = (float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0) - before
    measured.update(warmup_peak=warm, warmup_kept=kept, points=[], check=None, fit=None, verified=None)
    say(f"{role}: warm-up pass at {points_at[0][0]:,} tokens, not measured for the fit: peak {gib(warm)}, "
         f"{kept / 2**20:,.0f} MiB kept allocated after it (one-time: kernels, workspaces, optimizer state) "
         f"{took}")
    if warmed is not None:
        warmed()
    points = []
    for tokens, rows in points_at:
        peak = run(tokens, rows)
        if peak is None:
            refuse_oom()
        points.append((tokens, rows, peak))
        measured.update(points=list(points))
    fit = LinearPeak.fit(points)
    measured.update(fit=asdict(fit))
    check = None
    if check_at is not None:
        peak = run(*check_at)
        if peak is None:
            refuse_oom()
        check = FitCheck(*check_at, peak, fit(*check_at))
        measured.update(check={**asdict(check), "trusted": check.trusted})
        points.append((*check_at, peak))
        say(f"{role}: {describe_fit(fit)}; {check.describe()}")
        fit = LinearPeak.fit(points)  # least squares over every measured point
    return fit, check, points
