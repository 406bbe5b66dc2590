"""The demo's size for this machine: measure its speed first, then fit the work into the time.

Machines of one kind differ (two 2-core CPU machines of this project ran the demo's training 2x
apart). ``measure_speed`` times the shipped tiny target itself: a forward and backward pass over
one demo-sized batch on one thread, the work that regeneration and training are made of.
``size_demo`` turns that time into the demo's work: as many conversations (at most the demo's)
and training steps (at most its epochs) as fit in the minutes, fewer conversations only where they
would not get two epochs. The constants below are the demo's stages measured against the probe on
the project's 2-core machine (docs/benchmarks/2026-12-demo-sizing.md). Once the data is
made, the demo takes the probe again and ``steps_after_data`` fits the training into the time left.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

# Seconds of each stage per second of the probe, measured on the project's 2-core AMD EPYC (probe
# 0.98 s) and on two cores of an Intel Xeon (probe 0.47-0.57 s;
# docs/benchmarks/2026-12-demo-sizing.md).
REGENERATE_PER_CONVERSATION = 0.13
"""``draftline regenerate`` (64 new tokens per reply, batches of 32), per conversation (0.10-0.15 on the
EPYC; 0.13-0.25 on the Xeons, most of whose cores decode slowly against their probe: the regeneration gets
the time this plans, ``regeneration_minutes``, and makes fewer conversations there)."""
TRAIN_PER_STEP = 0.80
"""``draftline train``'s line (2 colocated processes, the drafters replicated), per optimizer step of two
1,024-token batches, one per process (0.76 on the development Xeon, 0.83-0.84 on two cores of the GPU
machine's Xeon; the 2 targets + 1 drafter line took 0.43 per batch on the EPYC and 0.42-0.53 on the
Xeons, where the probe varied more: the training's time limit cuts the rest)."""
HEAD = 25.0
"""What comes before the training and does not grow with the conversations: this probe, cutting the
conversations, the target's load for regeneration, ``draftline prepare``."""
TAIL = 40.0
TAIL_S = 30.0
"""What comes after the data and is not the training's steps, ``TAIL_S`` seconds plus ``TAIL`` probe
seconds (``tail_seconds``): the line's start (its processes import torch), the last small measurement,
the final checkpoint, ``draftline eval`` and ``draftline report``. Its start and the eval's decoding are
Python more than matrix work and do not slow with the probe: 94 s on an EPYC whose probe took 1.8 s
(with a longer final measurement since removed), about 60 s on a Xeon (0.54 s), 50 s and 32 s on EPYCs
at 0.66 and 0.72 s (docs/benchmarks/2026-12-demo-on-the-clock.md). The time limit ends the training ``tail_seconds`` before the
demo's end: what this over-counts is left unused, what it under-counts makes the demo late by as much."""
STEPS_PER_CONVERSATION = 0.1045
"""Optimizer steps of one epoch per conversation (1,280 regenerated conversations pack into 268
batches of 1,024 tokens, two per step)."""


@dataclass(frozen=True)
class DemoSize:
    probe_s: float
    conversations: int
    max_steps: int
    minutes: float
    """The whole demo's predicted wall time."""
    most_steps: int
    """The steps of every epoch of these conversations (the most the demo trains, however fast the machine)."""


def measure_speed(target_dir: Path, tokens: int = 1024, seconds: float = 2.0) -> float:
    """Median seconds of one forward and backward pass of the target over ``tokens`` tokens, one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        times = []
        end = time.perf_counter() + seconds
        for i in range(50):
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if i > 0:  # the first pass warms the allocator and kernels
                times.append(time.perf_counter() - start)
            if time.perf_counter() > end and len(times) >= 3:
                break
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def tail_seconds(probe_s: float) -> float:
    """Seconds of the demo after its last training step, on a machine whose probe took ``probe_s``."""
    return TAIL_S + TAIL * probe_s


def every_epoch_steps(conversations: int, epochs: float) -> int:
    """Optimizer steps of ``epochs`` passes over ``conversations`` (the most the demo trains)."""
    return math.ceil(STEPS_PER_CONVERSATION * conversations * epochs)


def predicted_minutes(probe_s: float, conversations: int, steps: int) -> float:
    work = HEAD + REGENERATE_PER_CONVERSATION * conversations + TRAIN_PER_STEP * steps
    return (probe_s * work + tail_seconds(probe_s)) / 60


def steps_that_fit(probe_s: float, seconds_left: float) -> int:
    """Training steps that fit in ``seconds_left``, what is left once the data is made."""
    return max(0, math.floor((seconds_left - tail_seconds(probe_s)) / probe_s / TRAIN_PER_STEP))


def size_demo(probe_s: float, minutes: float, conversations: int, epochs: int, fewest_epochs: float = 2.0, *,
              keep_conversations: bool = False) -> DemoSize:
    """Conversations and training steps for a demo of about ``minutes`` on a machine whose probe took
    ``probe_s``: the steps that fit, at most ``epochs`` over the data. Where the conversations would not
    get ``fewest_epochs`` in the time, fewer conversations (a multiple of 32, at least 160; not with
    ``keep_conversations``): at equal steps two epochs of more data beat four of less (docs/benchmarks/2026-12-demo-sizing.md).
    A machine too slow even for that runs longer than ``minutes``, and the prediction says so."""
    budget = (minutes * 60 - tail_seconds(probe_s)) / probe_s - HEAD
    if not keep_conversations:
        per_conversation = REGENERATE_PER_CONVERSATION + TRAIN_PER_STEP * STEPS_PER_CONVERSATION * fewest_epochs
        conversations = min(conversations, max(160, int(budget / per_conversation) // 32 * 32))
    most = every_epoch_steps(conversations, epochs)
    fewest = min(most, every_epoch_steps(conversations, fewest_epochs))
    fit = int((budget - REGENERATE_PER_CONVERSATION * conversations) // TRAIN_PER_STEP)
    chosen = max(fewest, min(most, fit))
    return DemoSize(probe_s, conversations, chosen, predicted_minutes(probe_s, conversations, chosen), most)


def regeneration_minutes(size: DemoSize) -> float:
    """The regeneration's time in the plan: ``draftline regenerate --max-minutes`` (decoding's speed
    against the probe differs by machine, 0.10-0.25 probe seconds per conversation: a slower one
    regenerates fewer conversations and leaves the training its time)."""
    return size.probe_s * REGENERATE_PER_CONVERSATION * size.conversations / 60


def with_conversations(size: DemoSize, conversations: int, epochs: int) -> DemoSize:
    """The plan for the conversations the regeneration made."""
    most = every_epoch_steps(conversations, epochs)
    return replace(size, conversations=conversations, max_steps=min(size.max_steps, most), most_steps=most)


STEP_HEADROOM = 1.5
"""The training's --max-steps over the steps predicted to fit (``step_cap``): the time limit ends it, and the
learning-rate schedule follows that clock, so a machine that trains faster than its probe says uses its time
instead of finishing early (the prediction is off by 10-20% between machines of one kind)."""


def step_cap(expected: int, most: int) -> int:
    """--max-steps for a training expected to take ``expected`` steps in its time: ``STEP_HEADROOM`` more, at
    most every epoch's ``most``."""
    return min(most, max(expected, math.ceil(STEP_HEADROOM * expected)))


FEWEST_STEPS = 50
"""The fewest training steps the demo runs however little time is left (a machine far slower than planned)."""


def training_limit_s(probe_s: float, seconds_left: float, steps: int) -> float:
    """The training's time limit (``--max-minutes``, counted from its first step): the time left less the
    tail, so that a machine slower than its probe still ends in time (its last steps are cut), and never
    less than ``steps`` (at most ``FEWEST_STEPS`` of them) take at the probe's speed."""
    return max(seconds_left - tail_seconds(probe_s), probe_s * TRAIN_PER_STEP * min(steps, FEWEST_STEPS))


PROBES_DISAGREE = 0.10
"""Past this fraction apart, the probe taken again is read a third time (``speed_now``)."""


def speed_now(first_s: float, measure: Callable[[], float]) -> float:
    """The machine's probe once the data is made: ``measure()`` again, and where it reads more than a
    tenth (``PROBES_DISAGREE``) off the first reading, once more and the median of the three. One
    reading disturbed by a burst of other work does not set the training's length (two demos on one
    machine: a pair read 0.572 s, then 0.656 s, trained at the first one's speed and ended 1.2 minutes
    early: docs/benchmarks/2026-12-demo-settings.md), while a machine that really
    slowed down, or sped up, reads so twice."""
    now = measure()
    if abs(now - first_s) <= PROBES_DISAGREE * first_s:
        return now
    return statistics.median([first_s, now, measure()])


def steps_after_data(size: DemoSize, probe_s: float, seconds_left: float) -> int:
    """The training's steps once the data is made, from the probe taken again just then (``probe_s``:
    the machine's speed now; its load can change within minutes): the time left decides (the promise is
    the minutes), at most every epoch's steps, at least ``FEWEST_STEPS``. Where the data came faster
    than planned the training gets that time too. The regeneration's own time is no measure of the
    training: decoding slowed against the probe on a machine whose training did not."""
    most = size.most_steps
    return max(min(FEWEST_STEPS, most), min(most, steps_that_fit(probe_s, seconds_left)))
