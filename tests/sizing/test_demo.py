"""The demo sized to the machine: the conversations and steps that fit the minutes, within the epochs."""

from __future__ import annotations

import math

import pytest

from draftline.demo.pipeline import TARGET
from draftline.sizing.demo import (
    FEWEST_STEPS, HEAD, REGENERATE_PER_CONVERSATION, STEP_HEADROOM, STEPS_PER_CONVERSATION, TRAIN_PER_STEP,
    measure_speed, predicted_minutes, size_demo, speed_now, step_cap, steps_after_data, steps_that_fit,
    tail_seconds, training_limit_s, with_conversations,
)


def _probe_for(minutes: float, conversations: int, steps: int) -> float:
    """The probe time of a machine on which ``conversations`` and ``steps`` take ``minutes``."""
    probe = minutes / predicted_minutes(1.0, conversations, steps)
    for _ in range(50):  # the tail's fixed seconds do not scale with the probe: solve by iteration
        probe *= minutes / predicted_minutes(probe, conversations, steps)
    return probe


def _epochs(size) -> float:
    return size.max_steps / (STEPS_PER_CONVERSATION * size.conversations)


def test_a_machine_that_fits_part_of_the_epochs_gets_every_conversation_and_the_steps_that_fit():
    steps = int(0.75 * STEPS_PER_CONVERSATION * 1280 * 10)  # three quarters of 10 epochs
    probe = _probe_for(7.0, 1280, steps)
    size = size_demo(probe, 7.0, 1280, epochs=10)
    assert size.conversations == 1280 and size.max_steps in (steps - 1, steps)
    assert size.minutes == pytest.approx(7.0, abs=0.01)


def test_a_fast_machine_stops_at_the_epochs_and_finishes_early():
    most = math.ceil(STEPS_PER_CONVERSATION * 1280 * 10)
    probe = _probe_for(7.0, 1280, 3 * most)
    size = size_demo(probe, 7.0, 1280, epochs=10)
    assert size.max_steps == most and size.minutes < 4.0


def test_a_slow_machine_keeps_two_epochs_with_fewer_conversations_then_runs_long():
    probe = _probe_for(7.0, 1280, int(1.1 * STEPS_PER_CONVERSATION * 1280))  # every conversation would get ~1.1 epochs
    size = size_demo(probe, 7.0, 1280, epochs=10)
    assert 160 <= size.conversations < 1280 and size.conversations % 32 == 0
    assert _epochs(size) >= 2.0 and size.minutes <= 7.0
    kept = size_demo(probe, 7.0, 1280, epochs=10, keep_conversations=True)  # asked for: kept, the steps fit
    assert kept.conversations == 1280 and kept.max_steps == math.ceil(STEPS_PER_CONVERSATION * 1280 * 2)
    slower = size_demo(probe * 8, 7.0, 1280, epochs=10)
    assert slower.conversations == 160 and _epochs(slower) >= 2.0 and slower.minutes > 7.0


def test_the_steps_that_fit_grow_with_the_time_left_and_shrink_with_a_slower_machine():
    assert steps_that_fit(0.5, 300) < steps_that_fit(0.5, 400)
    assert steps_that_fit(1.0, 400) < steps_that_fit(0.5, 400)
    assert steps_that_fit(0.5, 1.0) == 0


def test_after_the_data_the_probe_taken_again_and_the_time_left_decide_the_steps():
    """A machine that slowed after the first probe: the training gets what fits, below the plan."""
    size = size_demo(1.0, 7.0, 1280, epochs=10)
    left = 7.0 * 60 - HEAD - REGENERATE_PER_CONVERSATION * size.conversations  # the data took what was planned
    assert abs(steps_after_data(size, 1.0, left) - size.max_steps) <= 1
    slow = steps_after_data(size, 1.3, left)
    assert slow < 0.75 * size.max_steps and tail_seconds(1.3) + 1.3 * TRAIN_PER_STEP * slow <= left  # ends in time
    faster = steps_after_data(size, 0.5, left)  # faster now (or the data came early): the time left is used
    assert size.max_steps < faster <= size.most_steps and tail_seconds(0.5) + 0.5 * TRAIN_PER_STEP * faster <= left
    assert steps_after_data(size, 0.01, left) == size.most_steps  # never more than every epoch
    assert steps_after_data(size, 1.0, 1.0) == FEWEST_STEPS  # no time at all: the fewest


def test_the_probe_times_the_shipped_target():
    seconds = measure_speed(TARGET, tokens=128, seconds=0.2)
    assert 0 < seconds < 5


def test_the_training_time_limit_keeps_the_tail_back_and_allows_the_fewest_steps():
    probe, left = 0.5, 400.0
    steps = steps_after_data(size_demo(probe, 7.0, 1280, epochs=10), probe, left)
    limit = training_limit_s(probe, left, steps)
    assert limit == pytest.approx(left - tail_seconds(probe))
    assert probe * TRAIN_PER_STEP * steps <= limit  # the planned steps fit in the limit at the probe's speed
    assert training_limit_s(probe, 10.0, FEWEST_STEPS) == pytest.approx(probe * TRAIN_PER_STEP * FEWEST_STEPS)


def test_fewer_conversations_regenerated_than_planned_lower_the_most_steps_not_the_time():
    probe = 0.5
    size = size_demo(probe, 7.0, 1280, epochs=10)
    fewer = with_conversations(size, 320, epochs=10)
    assert fewer.conversations == 320 and fewer.most_steps == math.ceil(STEPS_PER_CONVERSATION * 320 * 10)
    left = 300.0
    steps = steps_after_data(fewer, probe, left)
    assert steps == min(fewer.most_steps, steps_that_fit(probe, left))  # the time left decides, within the epochs
    few = with_conversations(size, 32, epochs=10)  # so few that every epoch is fewer than the floor of steps
    assert few.most_steps < FEWEST_STEPS and steps_after_data(few, 0.5, 1.0) == few.most_steps


def test_the_probe_taken_again_is_read_a_third_time_only_where_it_disagrees_and_the_median_decides():
    def readings(*values):
        it = iter(values)
        calls = []

        def measure():
            calls.append(1)
            return next(it)
        return measure, calls

    measure, calls = readings(0.60)
    assert speed_now(0.57, measure) == 0.60 and len(calls) == 1  # within a tenth: the reading now
    measure, calls = readings(0.656, 0.55)
    assert speed_now(0.572, measure) == 0.572 and len(calls) == 2  # one slow reading outvoted
    measure, calls = readings(0.80, 0.82)
    assert speed_now(0.55, measure) == 0.80  # a machine that slowed down reads slow twice
    measure, calls = readings(0.45, 0.46)
    assert speed_now(0.59, measure) == 0.46  # and one that sped up, fast twice


def test_the_step_cap_leaves_the_time_limit_to_end_the_training_within_the_epochs():
    """--max-steps lies above the steps predicted to fit, so a machine faster than its probe trains until the time
    limit (the schedule follows the clock) instead of finishing early; never past every epoch."""
    assert step_cap(400, 2000) == math.ceil(STEP_HEADROOM * 400) > 400
    assert step_cap(400, 500) == 500
    assert step_cap(2000, 2000) == 2000
    assert step_cap(FEWEST_STEPS, 10_000) >= FEWEST_STEPS
