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
from draftline.errors import DraftlineError
from draftline.model.target import TargetFeatures
from draftline.objective.loss import DFlashObjective
from draftline.pipeline.drafter_worker import DrafterWorker
from helpers import FakeDevice
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


H200 = 139.81 * GIB  # cudaMemGetInfo's total on an H200
SEEDS_CARD = 94.97  # the RTX PRO 6000 Blackwell as torch reports it


def test_the_card_bounds_the_whole_device_not_the_allocator_alone(monkeypatch):
    """--gpu-memory-gib 94.97 on an H200: the allocator is capped to the card less what lies outside it (CUDA's
    context), so that the device's use as CUDA counts it stays within the card; as the outside grows (kernels
    loaded, another process), a refresh moves the cap down by as much."""
    device = FakeDevice(monkeypatch, total=H200, outside=0.5 * GIB)
    budget = memory.cap_device(0, SEEDS_CARD)
    assert budget.outside == 0.5 * GIB and device.cap == pytest.approx(SEEDS_CARD * GIB - 0.5 * GIB)
    assert budget.describe() == ("94.97 GiB of the device in all (--gpu-memory-gib) - 0.50 GiB outside the allocator "
                                 "(CUDA context, libraries, other processes) = 94.47 GiB for the allocator")
    device.reserved = device.cap  # the allocator at its cap: the device in use is exactly the card
    assert device.outside + device.reserved == pytest.approx(SEEDS_CARD * GIB)
    # kernels loaded, workspaces made, another process with 200 MB: the allocator reserves less
    device.reserved, device.outside = 10 * GIB, 0.5 * GIB + 0.55 * GIB + 200 * 2**20
    limit = memory_limit(torch.device("cuda", 0), 2.0)
    assert device.cap == pytest.approx(SEEDS_CARD * GIB - device.outside)
    assert limit.usable == pytest.approx(device.cap) and limit.limit == pytest.approx(device.cap - 2 * GIB)
    assert ("this process may use (--gpu-memory-gib 94.97 of the device less 1.25 GiB outside the allocator: CUDA "
            "context, libraries, other processes) - 2.0 GiB headroom") in limit.describe()
    # an out-of-memory message quotes the card without moving it
    fraction = device.fraction
    device.outside += 5 * GIB
    assert "--gpu-memory-gib 94.97" in memory_limit(torch.device("cuda", 0), 0.0, refresh=False).describe()
    assert device.fraction == fraction


def test_a_card_that_cannot_be_had_is_refused(monkeypatch):
    FakeDevice(monkeypatch, total=H200, outside=0.5 * GIB)
    with pytest.raises(DraftlineError, match=r"--gpu-memory-gib 150: the device has only 139.81 GiB"):
        memory.cap_device(0, 150)
    device = FakeDevice(monkeypatch, total=H200, outside=60 * GIB)  # other processes hold 60 GiB
    with pytest.raises(DraftlineError, match=r"60.00 GiB of the device are already in use outside this process's "
                                             r"allocator .* free the GPU"):
        memory.cap_device(0, 60.3)
    assert device.fraction == 1.0
    assert memory.device_budget(1) is None


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
# The run is a child process in its own session (process group), with a hard time limit: on a machine whose
# first compile is cold it must still end by itself; where it does not, the test prints every thread's stack
# (faulthandler, SIGUSR1), checks whether one SIGTERM ends it, and kills the whole group (the child, its
# compile workers), so that a hang fails this test instead of the session.
GPU_CHILD = r"""
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
import torch
from draftline.cli import main
from draftline.pipeline import loop
from draftline.distributed.compile_lock import COMPILE_LOCK

mode, args = sys.argv[1], sys.argv[2:]
if mode == "cap":  # after step 2, cap this process below what any pass needs
    total = torch.cuda.mem_get_info()[1]
    real_after_step = loop.after_step

    def after_step(record, worker, *parts):
        real_after_step(record, worker, *parts)
        if record.step == 2:
            with COMPILE_LOCK:  # no pass of the target thread in flight
                torch.cuda.synchronize()
                at_rest = torch.cuda.memory_allocated()
                transient = torch.cuda.max_memory_allocated() - at_rest
                torch.cuda.empty_cache()
                # below what any pass needs (a drafter pass alone materialises 4,096 x 4,096 fp32 logits and
                # their gradient, 128 MiB), above the few small tensors made between passes
                torch.cuda.set_per_process_memory_fraction((at_rest + min(transient / 4, 32 * 2**20)) / total)
            print(f"CAPPED {time.time():.3f}", flush=True)

    loop.after_step = after_step
    torch.cuda.reset_peak_memory_stats()  # the transient is measured over the run's first two steps
code = main(["train", *args])
print(f"EXIT {code} {time.time():.3f}", flush=True)
sys.exit(code)
"""


def _gpu_child(mode: str, args: list[str], limit_s: float, *, on_line=None) -> tuple[int, str, dict]:
    """Run ``draftline train ARGS`` in a child (``mode`` "cap": capped after step 2); (exit code, its output,
    {first word of a marker line: its time}). A child past ``limit_s`` fails the test, with its stacks."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    src = Path(memory.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(src), str(tests), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", GPU_CHILD, mode, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, marks = [], {}

    def read():
        for line in proc.stdout:
            lines.append(line)
            word = line.split(" ", 1)[0]
            if word in ("CAPPED", "EXIT") and word not in marks:
                marks[word] = time.time()
                if on_line is not None:
                    on_line(word, proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack, where it hangs
        time.sleep(3)
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
            after = f"one SIGTERM ended it (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            after = "one SIGTERM did NOT end it within 15 s"
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        pytest.fail(f"`draftline train` ({mode}) did not end within {limit_s:.0f} s; {after}; its output and "
                    f"stacks:\n{''.join(lines)[-12000:]}")
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # what is left of its group (compile workers)
    reader.join(timeout=5)
    marks["end"] = time.time()
    return proc.returncode, "".join(lines), marks


def _signal_group(pgid: int, signum: int) -> None:
    import os

    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group has ended
        pass


@pytest.fixture(scope="module")
def gpu_line(tmp_path_factory):
    from helpers import make_qwen3_target

    root = tmp_path_factory.mktemp("gpu_line")
    target = make_qwen3_target(root / "target", vocab_size=4096, hidden_size=256, num_layers=4, intermediate_size=1024)
    data = write_dataset(root / "data", vocab_size=4096, num_docs=400, min_len=300, max_len=500)
    return target, data


def _gpu_args(target, data, out, **extra) -> list[str]:
    args = base_args(target, data, out, save_every=1000, token_budget=16384, max_anchors=256, max_batch_size=64,
                     **extra)
    args[args.index("--device") + 1] = "cuda"
    return [*args, "--block-size", "16", "--no-preflight"]


@pytest.mark.gpu
@pytest.mark.timeout(480, method="thread")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_real_out_of_memory_mid_run_is_named_with_the_batch_and_exits_1(gpu_line, tmp_path):
    """A tiny line on CUDA (--no-preflight); after step 2 the process is capped (per-process memory fraction)
    below what a pass needs, so the next pass runs out of memory for real: the run ends by itself, within a
    minute of the cap, named, with a checkpoint that --resume continues from. 30-60 s warm, each child."""
    target, data = gpu_line
    out = tmp_path / "run"
    code, text, marks = _gpu_child("cap", _gpu_args(target, data, out, max_steps=50), limit_s=240)
    assert "CAPPED" in marks, "the cap was never set (the run ended before step 2): " + text[-3000:]
    assert code == 1, text[-3000:]
    assert marks["end"] - marks["CAPPED"] < 60, f"{marks['end'] - marks['CAPPED']:.0f} s from the cap to the exit"
    assert "Traceback" not in text, text[-3000:]
    line = next(line for line in text.splitlines() if "run failed:" in line)
    assert re.search(r"colocated rank 0 \(host \S+, GPU 0 [^,]+, pid \d+\) failed: out of GPU memory in the "
                     r"(drafter's pass \d+|target's pass|drafter's optimizer step)", line), line
    assert re.search(r"batch \d+ .*the batch: [\d,]+ tokens in \d+ documents", line) or "optimizer step" in line, line
    assert "set_per_process_memory_fraction" in line, line  # the process's limit, not the device
    assert "To fit: lower" in line
    match = re.search(r"checkpoint of the last completed step \((\d+)\) saved", text)
    assert match and int(match.group(1)) >= 2, text[-3000:]
    saved = int(match.group(1))
    assert latest_checkpoint(out).name.endswith(f"{saved:08d}")

    # The checkpoint is resumable: the same run, without the cap, continues from it to its end.
    code, text, _ = _gpu_child("plain", [*_gpu_args(target, data, out, max_steps=saved + 2), "--resume"], limit_s=180)
    assert code == 0, text[-3000:]
    assert f"draftline: resume run in {out} from " in text and f"(step {saved})" in text, text[-3000:]
    assert f"finished at step {saved + 2}" in text, text[-3000:]


@pytest.mark.gpu
@pytest.mark.timeout(330, method="thread")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_sigterm_as_the_memory_runs_out_ends_the_run(gpu_line, tmp_path):
    """SIGTERM to the run's whole process group the moment the cap is set: whether the out of memory or the
    stop comes first, the run ends within a minute (1: failed, named; 0: stopped with a checkpoint)."""
    import signal

    target, data = gpu_line
    sent = {}

    def terminate(word, proc):
        if word == "CAPPED":
            _signal_group(proc.pid, signal.SIGTERM)
            sent["at"] = True

    code, text, marks = _gpu_child("cap", _gpu_args(target, data, tmp_path / "run", max_steps=50), limit_s=240,
                                   on_line=terminate)
    assert sent, "the cap was never set: " + text[-3000:]
    assert marks["end"] - marks["CAPPED"] < 60, f"{marks['end'] - marks['CAPPED']:.0f} s from SIGTERM to the exit"
    assert code in (0, 1), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert ("out of GPU memory" in text) if code == 1 else ("continue with the same command and --resume" in text)


HOG = """
import sys, torch
held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
print(f"HELD {total - free}", flush=True)
sys.stdin.read()  # until the test closes it
"""


@pytest.mark.gpu
@pytest.mark.timeout(600, method="thread")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_taken_after_the_plan_is_caught_at_start(gpu_line, tmp_path):
    """The +200 MB day on a real GPU. A tiny line measures its worst case under a generous card; the card is then
    set to what it needs plus 150 MB, and it trains. Another process then takes 200 MB of the device (and its own
    CUDA context): the same command is refused by preflight at start, naming sizes that fit, and never runs out of
    memory at its first optimizer step; the sizes it names train with the other process still there."""
    import json
    import subprocess
    import sys

    from draftline.sizing.preflight import suggested_flags

    target, data = gpu_line

    def args(out, *extra):
        return [*_gpu_args(target, data, out, max_steps=2)[:-1], "--memory-headroom-gib", "0.25", "--no-compile",
                *extra]

    code, text, _ = _gpu_child("plain", args(tmp_path / "plan", "--gpu-memory-gib", "24"), limit_s=180)
    assert code == 0, text[-3000:]
    record = json.loads((tmp_path / "plan" / "preflight" / "rank-0.json").read_text())["drafter"]
    assert record["whole"] == 24 * GIB and 0 < record["outside"] < 4 * GIB  # the card, measured after the warm-up
    need = record["peak_bytes"] + record["outside"] + record["headroom"]
    card = f"{(need + 150 * 2**20) / GIB:.3f}"
    code, text, _ = _gpu_child("plain", args(tmp_path / "fits", "--gpu-memory-gib", card), limit_s=180)
    assert code == 0 and "out of GPU memory" not in text, text[-3000:]

    hog = subprocess.Popen([sys.executable, "-c", HOG, str(200 * 2**20)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        held = hog.stdout.readline()
        assert held.startswith("HELD "), held
        code, text, _ = _gpu_child("plain", args(tmp_path / "day", "--gpu-memory-gib", card), limit_s=180)
        assert code != 0 and "out of GPU memory" not in text and "Traceback" not in text, text[-3000:]
        refusal = next(line for line in text.splitlines() if "preflight: the " in line)
        assert "outside the allocator" in refusal, refusal
        assert not list((tmp_path / "day").glob("checkpoints/step-*")), "a step was trained"
        fix = suggested_flags(refusal)
        assert fix, refusal
        # The fix is read off preflight's fit (trusted within 0.25 GiB + 2%): at the edge of a card this small a
        # second refusal may name a further one, which a user adds to the first (the flags of the later fix win).
        # Either way: refused at start or trained, never out of memory.
        flags = {fix[0]: fix[1:]}
        for attempt in range(3):
            fixed = [item for flag, value in flags.items() for item in (flag, *value)]
            code, text, _ = _gpu_child("plain", args(tmp_path / f"fixed-{attempt}", "--gpu-memory-gib", card, *fixed),
                                       limit_s=180)
            assert "out of GPU memory" not in text and "Traceback" not in text, text[-3000:]
            refusal = next((line for line in text.splitlines() if "preflight: the " in line), None)
            if code == 0 or refusal is None:
                break
            fix = suggested_flags(refusal)
            assert fix, refusal
            flags[fix[0]] = fix[1:]
        assert code == 0, text[-3000:]
    finally:
        hog.stdin.close()
        hog.wait(timeout=30)
