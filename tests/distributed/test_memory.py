"""Running out of memory in the middle of a run: the message names the rank, the pass and the batch's
size (tokens, documents, query rows), the memory this process may use (not the whole device) and what
to lower; a checkpoint of the last completed step is saved and the run exits 1.

On CPU a pass raises ``torch.OutOfMemoryError`` (patched) in a real in-process line, and the limit is
read from faked CUDA figures; the GPU test runs a real line on CUDA into a real allocator limit.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftline.checkpoint.state import latest_checkpoint
from draftline.cli import main
from draftline.distributed import memory
from draftline.distributed.memory import OutOfMemoryContext, describe_out_of_memory, memory_limit
from draftline.model.target import TargetFeatures
from draftline.objective.loss import DFlashObjective
from draftline.pipeline.drafter_worker import DrafterWorker
from line_helpers import base_args, read_jsonl, write_dataset

GIB = 2**30
# CUDA's own text: it quotes the whole device (139.8 GiB), not what this process may use.
CUDA_TEXT = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
             "90.12 GiB is free. Including non-PyTorch memory, this process has 48.20 GiB memory in use.")


def _fake_cuda(monkeypatch, *, total, fraction, free, reserved, peak=40 * GIB):
    """The CUDA figures memory_limit reads, faked (no GPU here)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: reserved)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(memory, "_peak_allocated", lambda device: peak)


def test_the_limit_read_from_the_device_is_the_process_share(monkeypatch):
    cuda = torch.device("cuda", 0)
    _fake_cuda(monkeypatch, total=140 * GIB, fraction=0.35, free=120 * GIB, reserved=10 * GIB)
    capped = memory_limit(cuda, 2.0)
    assert capped.usable == pytest.approx(49 * GIB) and capped.limit == pytest.approx(47 * GIB)
    _fake_cuda(monkeypatch, total=140 * GIB, fraction=1.0, free=30 * GIB, reserved=10 * GIB)
    shared = memory_limit(cuda, 2.0)  # other processes hold 100 GiB
    assert shared.usable == 40 * GIB and "30.0 GiB free on the device + 10.0 GiB this process holds" in shared.describe()


def _context(device):
    return OutOfMemoryContext(where="the drafter's pass 2 of batch 17 (step 5)", sizes="the batch: 8,192 tokens",
                              advice="lower --max-query-rows", device=device)


@pytest.mark.parametrize("fraction,free,quoted", [
    (0.35, 120 * GIB, "this process may use 49.0 GiB (35% of the device's 140.0 GiB (torch.cuda.set_per_process_memory_fraction))"),
    (1.0, 30 * GIB, "this process may use 40.0 GiB (30.0 GiB free on the device + 10.0 GiB this process holds; "
                    "other processes use the rest)"),
], ids=["fraction-cap", "other-processes"])
def test_the_mid_run_message_quotes_what_the_process_may_use(monkeypatch, fraction, free, quoted):
    _fake_cuda(monkeypatch, total=140 * GIB, fraction=fraction, free=free, reserved=10 * GIB)
    exc = torch.OutOfMemoryError(CUDA_TEXT)
    with pytest.raises(torch.OutOfMemoryError):
        with memory.out_of_memory_context(torch.device("cuda", 0), lambda: _context(torch.device("cuda", 0))):
            raise exc
    message = describe_out_of_memory(exc)
    assert message.startswith("out of GPU memory in the drafter's pass 2 of batch 17 (step 5) (the batch: 8,192 tokens)")
    assert "it tried to allocate 2.50 GiB more" in message
    assert quoted in message, message
    assert "its allocator held 10.0 GiB, the peak allocated was 40.0 GiB" in message
    assert "139.81" not in message and "total capacity" not in message  # not the whole device
    assert message.endswith("To fit: lower --max-query-rows")


def test_the_innermost_context_wins_and_other_errors_pass_through():
    outer = lambda: _context(torch.device("cpu"))  # noqa: E731
    inner = OutOfMemoryContext("inner", "s", "a", torch.device("cpu"))
    with pytest.raises(torch.OutOfMemoryError) as info:
        with memory.out_of_memory_context(torch.device("cpu"), outer):
            with memory.out_of_memory_context(torch.device("cpu"), lambda: inner):
                raise torch.OutOfMemoryError("CUDA out of memory.")
    assert memory.context_of(info.value) is inner
    # an out-of-memory error wrapped by another (a compiler's, while it benchmarked kernels) is found and told
    with pytest.raises(RuntimeError) as info:
        with memory.out_of_memory_context(torch.device("cpu"), outer):
            try:
                raise torch.OutOfMemoryError(CUDA_TEXT)
            except torch.OutOfMemoryError as oom:
                raise RuntimeError("InductorError: benchmarking failed") from oom
    from draftline.distributed.health import describe_exception

    assert describe_exception(info.value).startswith("out of GPU memory in the drafter's pass 2 of batch 17")
    with pytest.raises(KeyError):
        with memory.out_of_memory_context(torch.device("cpu"), outer):
            raise KeyError("not memory")


# ---------------------------------------------------------------- in a real line on CPU, a patched pass runs out
def _out_of_memory_at(monkeypatch, cls, name, call: int, seen: list):
    """Make ``cls.name`` raise torch.OutOfMemoryError (CUDA's text) at its ``call``-th call."""
    real = getattr(cls, name)
    calls = [0]

    def patched(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            seen.append(args)
            raise torch.OutOfMemoryError(CUDA_TEXT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, patched)


def _train(qwen3_target, line_data, out, capsys):
    code = main(["train", *base_args(qwen3_target, line_data, out, max_steps=20, save_every=1000)])
    return code, capsys.readouterr().err


def test_a_drafter_pass_out_of_memory_names_rank_pass_and_batch_sizes(qwen3_target, line_data, tmp_path,
                                                                      monkeypatch, capsys):
    deliveries, seen = [], []
    real_accumulate = DrafterWorker.accumulate

    def accumulate(self, batches):
        deliveries.extend((d.seq, d.batch.num_tokens, d.batch.num_docs, self.step) for d in batches)
        return real_accumulate(self, batches)

    monkeypatch.setattr(DrafterWorker, "accumulate", accumulate)
    _out_of_memory_at(monkeypatch, DFlashObjective, "__call__", 4, seen)
    out = tmp_path / "run"
    code, err = _train(qwen3_target, line_data, out, capsys)
    assert code == 1, err[-3000:]
    seq, tokens, docs, step = deliveries[-1]
    features, blocks = seen[0]
    rows = blocks.num_anchors * 4
    line = next(line for line in err.splitlines() if "run failed:" in line)
    assert re.search(r"colocated rank 0 \(host \S+, CPU, pid \d+\) failed: out of GPU memory", line), line
    assert (f"in the drafter's pass 1 of batch {seq} (step {step + 1}) (the batch: {tokens:,} tokens in {docs} "
            f"documents; the pass: {rows:,} query rows ({blocks.num_anchors} anchors x block 4) over "
            f"{features.shape[0]:,} context tokens") in line, line
    assert "it tried to allocate 2.50 GiB more" in line and "total capacity" not in line
    assert "To fit: lower --max-query-rows (now 32,768: the rows of one pass) or --token-budget" in line
    assert f"checkpoint of the last completed step ({step}) saved" in err
    assert latest_checkpoint(out).name.endswith(f"{step:08d}")
    failure = json.loads((out / "failure.json").read_text())
    assert f"batch {seq} " in failure["message"] and failure["step"] == step
    assert read_jsonl(out / "metrics.jsonl")[-1]["status"] == "failed"


def test_a_target_pass_out_of_memory_names_rank_pass_and_batch_sizes(qwen3_target, line_data, tmp_path,
                                                                     monkeypatch, capsys):
    seen = []
    _out_of_memory_at(monkeypatch, TargetFeatures, "__call__", 5, seen)
    out = tmp_path / "run"
    code, err = _train(qwen3_target, line_data, out, capsys)
    assert code == 1, err[-3000:]
    (batch,) = seen[0]
    line = next(line for line in err.splitlines() if "run failed:" in line)
    assert re.search(r"colocated rank 0 \(host \S+, CPU, pid \d+\) failed: out of GPU memory", line), line
    assert (f"in the target's pass of batch {batch.index} (the batch: {batch.num_tokens:,} tokens in "
            f"{batch.num_docs} documents, longest {int(batch.doc_lengths.max()):,};") in line, line
    assert "feature batches waiting in its outbox" in line and "(in its target thread)" in line
    assert "To fit: lower --token-budget (this batch: " in line and "--q-hs" in line
    assert "checkpoint of the last completed step" in err and latest_checkpoint(out) is not None


# ---------------------------------------------------------------- on a GPU: a real line into a real limit
@pytest.mark.gpu
def test_gpu_a_real_out_of_memory_mid_run_is_named_with_the_batch_and_exits_1(tmp_path, monkeypatch, capsys):
    """A tiny line on CUDA (--no-preflight); after step 2 the process is capped (per-process memory
    fraction) below what a pass needs, so the next pass runs out of memory for real. About 30-60 s on
    one GPU (CUDA start, flex attention compiled for the target and the drafter, 3 steps)."""
    from draftline.pipeline import loop
    from draftline.distributed.compile_lock import COMPILE_LOCK
    from helpers import make_qwen3_target

    target = make_qwen3_target(tmp_path / "target", vocab_size=4096, hidden_size=256, num_layers=4,
                               intermediate_size=1024)
    data = write_dataset(tmp_path / "data", vocab_size=4096, num_docs=400, min_len=300, max_len=500)
    total = torch.cuda.mem_get_info()[1]
    capped = {}
    real_after_step = loop.after_step

    def after_step(record, worker, *parts):
        real_after_step(record, worker, *parts)
        if record.step == 2 and not capped:
            with COMPILE_LOCK:  # no pass of the target thread in flight
                torch.cuda.synchronize()
                at_rest = torch.cuda.memory_allocated()
                transient = torch.cuda.max_memory_allocated() - at_rest
                torch.cuda.empty_cache()
                # below what any pass needs (a drafter pass alone materialises 4,096 x 4,096 fp32 logits and
                # their gradient, 128 MiB), above the few small tensors made between passes
                capped["bytes"] = at_rest + min(transient / 4, 32 * 2**20)
                torch.cuda.set_per_process_memory_fraction(capped["bytes"] / total)

    monkeypatch.setattr(loop, "after_step", after_step)
    out = tmp_path / "run"
    args = base_args(target, data, out, max_steps=50, save_every=1000, token_budget=16384, max_anchors=256,
                     max_batch_size=64)
    args[args.index("--device") + 1] = "cuda"
    torch.cuda.reset_peak_memory_stats()  # the transient is measured over this run's first two steps
    try:
        code = main(["train", *args, "--block-size", "16", "--no-preflight"])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    err = capsys.readouterr().err
    assert capped, "the cap was never set (the run ended before step 2)"
    assert code == 1, err[-3000:]
    line = next(line for line in err.splitlines() if "run failed:" in line)
    assert re.search(r"colocated rank 0 \(host \S+, GPU 0 [^,]+, pid \d+\) failed: out of GPU memory in the "
                     r"(drafter's pass \d+|target's pass|drafter's optimizer step)", line), line
    assert re.search(r"batch \d+ .*the batch: [\d,]+ tokens in \d+ documents", line) or "optimizer step" in line, line
    assert "set_per_process_memory_fraction" in line, line  # the process's limit, not the device
    assert "To fit: lower" in line
    match = re.search(r"checkpoint of the last completed step \((\d+)\) saved", err)
    assert match and int(match.group(1)) >= 2, err[-3000:]
    assert latest_checkpoint(out).name.endswith(f"{int(match.group(1)):08d}")
