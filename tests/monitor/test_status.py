"""LineStatus records, windowed rates, ETA."""

from __future__ import annotations

import math
import time

import pytest

from draftline.monitor.status import LineStatus, RateMeter, eta_seconds, format_duration

# docs/ARCHITECTURE.md, metrics.jsonl, kind "train".
TRAIN_FIELDS = {
    "kind", "time", "elapsed_s", "step", "total_steps", "epoch", "samples", "tokens", "loss", "accuracy",
    "accuracy_by_position", "tau", "tau_step", "tf_acceptance", "lr", "grad_norm", "skipped_steps", "ktok_s", "samples_s",
    "tflops", "mfu", "mfu_ceiling", "q_pre", "q_hs", "q_hs_capacity", "target_wait", "drafter_wait", "target_batches_s", "drafter_batches_s",
    "eta_s", "compile_s", "compiling_s", "gpus", "num_epochs", "epochs_done", "layout",
}


def test_record_has_exactly_the_documented_fields(busy_status):
    record = busy_status.to_record()
    assert set(record) == TRAIN_FIELDS
    assert record["kind"] == "train" and record["step"] == 1234 and record["q_pre"] == [3, 12]
    assert record["gpus"][0] == {"rank": 0, "role": "target", "name": "NVIDIA H200", "mem_used_gib": 61.2,
                                 "mem_total_gib": 139.8, "mem_allocated_gib": None, "mem_budget_gib": None,
                                 "alloc_retries": None, "util": 0.97, "sm_mhz": 1755.0, "max_sm_mhz": 1980.0,
                                 "power_w": 699.0, "clock_reasons": ["power cap"]}
    assert set(LineStatus().to_record()) == TRAIN_FIELDS


def test_rate_meter_over_a_window():
    meter = RateMeter(window_s=10.0, now=0.0)
    assert math.isnan(meter.rate(now=0.0))
    meter.add(100, now=1.0)
    meter.add(100, now=2.0)
    assert meter.rate(now=2.0) == pytest.approx(100.0)
    assert meter.rate(now=20.0) == 0.0  # nothing arrived in the last 10 s: the rate falls, not freezes
    meter.add(50, now=15.0)
    # An amount is spread over the interval since the previous one (it was produced over 2..15 s). At 20 s the
    # producer is within its usual interval (13 s) of its last amount, so the window ends there: 5..15 s, which
    # holds 10/13 of it.
    assert meter.rate(now=20.0) == pytest.approx(50 * 10 / 13 / 10)
    meter.add(50, now=20.0)
    assert meter.rate(now=20.0) == pytest.approx((50 * 5 / 13 + 50) / 10)
    assert meter.total == 300


def test_rate_meter_interpolates_the_window_start():
    meter = RateMeter(window_s=10.0, now=0.0)
    meter.add(100, now=5.0)
    meter.add(100, now=15.0)
    assert meter.rate(now=15.0) == pytest.approx(10.0)
    assert meter.rate(now=20.0) == pytest.approx(10.0)  # within the usual 10 s of the last amount: no fall yet
    assert meter.rate(now=30.0) == pytest.approx(5.0)  # 5 s overdue: the window 10..20 s holds half of 5..15
    assert meter.rate(now=40.0) == 0.0


@pytest.mark.parametrize("phase", [0.0, 0.6, 1.2, 2.3])
def test_rate_meter_is_not_low_between_steps(phase):
    # Steps of 2.4 s, 16,384 tokens each, in a 30 s window: read at any moment between two steps, the rate is the
    # producer's (a window ending at "now" read up to 8% low, 4% on average).
    meter = RateMeter(window_s=30.0, now=0.0)
    for step in range(1, 40):
        meter.add(16384, now=2.4 * step)
    assert meter.rate(now=2.4 * 39 + phase) == pytest.approx(16384 / 2.4)


def test_waited_seconds_give_a_waiting_fraction():
    waits = RateMeter(window_s=10.0, now=0.0)
    waits.add(1.5, now=4.0)
    waits.add(2.0, now=10.0)
    assert waits.rate(now=10.0) == pytest.approx(0.35)


def test_eta_and_durations():
    assert eta_seconds(100, 1100, 2.0) == 500.0
    assert eta_seconds(100, None, 2.0) is None
    assert eta_seconds(100, 1100, float("nan")) is None
    assert eta_seconds(100, 1100, 0.0) is None
    # A time limit that comes before the last step ends the run there (--max-minutes).
    now = time.time()
    assert 99 <= eta_seconds(100, 1100, 2.0, ends_at=now + 100) <= 100
    assert eta_seconds(100, 1100, 2.0, ends_at=now + 1000) == 500.0
    assert 99 <= eta_seconds(100, 1100, float("nan"), ends_at=now + 100) <= 100
    assert format_duration(3725) == "1h02m"
    assert format_duration(59) == "0m59s"
    assert format_duration(2 * 86400 + 3 * 3600) == "2d03h"
    assert format_duration(None) == "n/a"


def test_rate_meter_rejects_a_bad_window():
    with pytest.raises(ValueError):
        RateMeter(window_s=0)
