"""The compile clock counts the time torch.compile spends compiling, and only that."""

from __future__ import annotations

import time

import torch

from draftline import compile_clock


def test_a_compilation_is_counted_and_a_compiled_call_is_not():
    compile_clock.install()
    compile_clock.install()  # twice: counted once

    def f(x):
        return torch.sin(x) * 2 + 1

    compiled = torch.compile(f, backend="aot_eager", dynamic=False)
    before = compile_clock.compile_seconds()
    started = time.perf_counter()
    compiled(torch.ones(5))  # a first shape: compiled
    first = compile_clock.compile_seconds() - before
    assert 0.0 < first <= time.perf_counter() - started

    after_first = compile_clock.compile_seconds()
    for _ in range(20):
        compiled(torch.ones(5))  # the same shape: nothing compiled
    assert compile_clock.compile_seconds() == after_first

    compiled(torch.ones(7))  # a new shape, static: compiled again
    assert compile_clock.compile_seconds() > after_first


def test_a_compilation_under_way_is_counted_to_now():
    compile_clock.install()
    compile_clock._started()
    try:
        a = compile_clock.compile_seconds()
        time.sleep(0.01)
        assert compile_clock.compile_seconds() >= a + 0.009
    finally:
        compile_clock._ended()
    done = compile_clock.compile_seconds()
    time.sleep(0.01)
    assert compile_clock.compile_seconds() == done


def test_a_torch_without_compile_callbacks_leaves_the_figure_unknown(monkeypatch):
    import math
    import sys

    monkeypatch.setattr(compile_clock, "_state", {"installed": False, "unavailable": False, "total": 0.0, "since": None})
    monkeypatch.setitem(sys.modules, "torch._dynamo.callback", None)  # its import fails
    compile_clock.install()
    assert math.isnan(compile_clock.compile_seconds())


def test_took_names_the_compiling_in_a_wall_time_only_when_there_was_some():
    import re

    compile_clock.install()
    took = compile_clock.Took()
    assert re.fullmatch(r"\(\d+\.\d s\)", str(took))
    took = compile_clock.Took()
    compile_clock._started()  # a compilation of 0.1 s, as dynamo's callbacks mark one
    time.sleep(0.1)
    compile_clock._ended()
    match = re.fullmatch(r"\((\d+\.\d) s, (\d+\.\d) of it compiling\)", str(took))
    assert match and 0.1 <= float(match[2]) <= float(match[1]) + 0.05


def test_counting_goes_on_after_dynamo_is_reset():
    """``torch._dynamo.reset()`` (tests, benches) drops dynamo's callbacks: the next reading installs them again."""
    compile_clock.install()
    torch._dynamo.reset()
    before = compile_clock.compile_seconds()
    compiled = torch.compile(lambda x: torch.tan(x) - 1, backend="aot_eager", dynamic=False)
    compiled(torch.ones(4))
    assert compile_clock.compile_seconds() > before
