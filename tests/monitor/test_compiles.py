"""The compile clock counts the time torch.compile spends compiling, and only that."""

from __future__ import annotations

import time

import torch

from draftline.monitor import compiles


def test_a_compilation_is_counted_and_a_compiled_call_is_not():
    compiles.install()
    compiles.install()  # twice: counted once

    def f(x):
        return torch.sin(x) * 2 + 1

    compiled = torch.compile(f, backend="aot_eager", dynamic=False)
    before = compiles.compile_seconds()
    started = time.perf_counter()
    compiled(torch.ones(5))  # a first shape: compiled
    first = compiles.compile_seconds() - before
    assert 0.0 < first <= time.perf_counter() - started

    after_first = compiles.compile_seconds()
    for _ in range(20):
        compiled(torch.ones(5))  # the same shape: nothing compiled
    assert compiles.compile_seconds() == after_first

    compiled(torch.ones(7))  # a new shape, static: compiled again
    assert compiles.compile_seconds() > after_first


def test_a_compilation_under_way_is_counted_to_now():
    compiles.install()
    compiles._started()
    try:
        a = compiles.compile_seconds()
        time.sleep(0.01)
        assert compiles.compile_seconds() >= a + 0.009
    finally:
        compiles._ended()
    done = compiles.compile_seconds()
    time.sleep(0.01)
    assert compiles.compile_seconds() == done


def test_a_torch_without_compile_callbacks_leaves_the_figure_unknown(monkeypatch):
    import math
    import sys

    monkeypatch.setattr(compiles, "_state", {"installed": False, "total": 0.0, "since": None})
    monkeypatch.setitem(sys.modules, "torch._dynamo.callback", None)  # its import fails
    compiles.install()
    assert math.isnan(compiles.compile_seconds())
