"""The compile clock counts the time torch.compile spends compiling and the time Triton spends compiling a library's
kernels outside it, and only that."""

from __future__ import annotations

import time

import pytest
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


class _FakeTriton:
    """``triton.knobs.runtime`` as Triton 3.4+ has it: the hook before a kernel compiles and the one after, which
    Triton calls with keyword arguments only (the kernel's cache key, its function's information, ...)."""

    def __init__(self, before=None, after=None):
        import types

        self.runtime = types.SimpleNamespace(jit_cache_hook=before, jit_post_compile_hook=after)
        self.module = types.ModuleType("triton")
        self.module.knobs = types.SimpleNamespace(runtime=self.runtime)

    def compile(self, name: str, key: str, seconds: float):
        """What Triton's ``_do_compile`` does around a compilation: None if the hook before took it over."""
        import types

        info = dict(key=key, repr=name, fn=types.SimpleNamespace(name=name), compile={"key": key},
                    is_manual_warmup=False, already_compiled=False)
        if self.runtime.jit_cache_hook is not None and self.runtime.jit_cache_hook(**info):
            return None
        time.sleep(seconds)
        if self.runtime.jit_post_compile_hook is not None:
            self.runtime.jit_post_compile_hook(**info)
        return name


def test_a_triton_kernel_compiled_outside_torch_compile_is_counted_once(monkeypatch):
    import sys

    seen = []
    fake = _FakeTriton(before=lambda **info: seen.append(("before", info["key"])),
                       after=lambda **info: seen.append(("after", info["key"])))
    monkeypatch.setitem(sys.modules, "triton", fake.module)
    monkeypatch.setattr(compile_clock, "_triton_started", {})
    compile_clock._install_triton_hooks()
    compile_clock._install_triton_hooks()  # twice: hooked once
    start = compile_clock.compile_seconds()
    assert fake.compile("rows_kernel", "[('*bf16', 'D')]", 0.05) == "rows_kernel"
    counted = compile_clock.compile_seconds() - start
    assert 0.05 <= counted < 0.5
    assert seen == [("before", "[('*bf16', 'D')]"), ("after", "[('*bf16', 'D')]")]  # the hooks set before, still called

    # Inside torch.compile's own compilation its time holds the kernel: not counted again.
    before = compile_clock.compile_seconds()
    started = time.perf_counter()
    compile_clock._started()
    try:
        fake.compile("inductor_kernel", "k", 0.05)
    finally:
        compile_clock._ended()
    window = time.perf_counter() - started
    assert compile_clock.compile_seconds() - before <= window + 0.001  # once, not window + 0.05
    assert not compile_clock._triton_started


def test_a_triton_compilation_that_a_hook_before_takes_over_is_not_timed(monkeypatch):
    import sys

    fake = _FakeTriton(before=lambda **info: True)  # e.g. a cache of compiled kernels of its own
    monkeypatch.setitem(sys.modules, "triton", fake.module)
    monkeypatch.setattr(compile_clock, "_triton_started", {})
    compile_clock._install_triton_hooks()
    start = compile_clock.compile_seconds()
    assert fake.compile("k", "key", 0.05) is None
    assert compile_clock.compile_seconds() == start and not compile_clock._triton_started


def test_a_triton_without_compile_hooks_or_none_at_all_is_no_error(monkeypatch):
    import sys
    import types

    for module in (None, types.ModuleType("triton")):  # no Triton; a Triton without knobs
        monkeypatch.setitem(sys.modules, "triton", module)
        compile_clock._install_triton_hooks()  # no error


@pytest.mark.gpu
def test_a_real_triton_kernel_compiled_at_its_first_launch_is_counted():
    """Triton's own hooks, on the GPU: a kernel of this test, launched at a size it has not been compiled for."""
    import triton
    import triton.language as tl

    @triton.jit
    def twice(x, out, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + offsets, 2 * tl.load(x + offsets, mask=offsets < n), mask=offsets < n)

    compile_clock.install()
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    before = compile_clock.compile_seconds()
    started = time.perf_counter()
    twice[(1,)](x, out, x.numel(), BLOCK=128)
    torch.cuda.synchronize()
    counted = compile_clock.compile_seconds() - before
    assert 0 < counted <= time.perf_counter() - started
    assert torch.equal(out, 2 * x)
    again = compile_clock.compile_seconds()
    twice[(1,)](x, out, x.numel(), BLOCK=128)  # compiled already: nothing counted
    assert compile_clock.compile_seconds() == again
