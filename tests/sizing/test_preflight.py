"""Preflight: measure at small sizes, extrapolate linearly, verify once; a refusal states the largest
token budget and query rows that fit; the limit is what the process may use; a resume says what changed.

The CPU tests run the real target and drafter passes with a stand-in for the CUDA peak counter (a
known linear law), so the search logic is checked exactly; the GPU tests measure for real.
"""

from __future__ import annotations

import re
import dataclasses

import pytest
import torch

from draftline.config import TrainConfig
from draftline.distributed.health import Health, local_rank_info
from draftline.distributed.memory import MemoryLimit
from draftline.distributed.roles import DRAFTER, Role
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config
from draftline.model.target import TargetFeatures, load_target_config
from draftline.objective import blocks as blocks_module
from draftline.objective import loss as loss_module
from draftline.pipeline.build import build_drafter_worker
from draftline.pipeline.spec import ModelSpec, RunSpec
from draftline.sizing import preflight
from draftline.sizing.peak_fit import LinearPeak
from draftline.sizing.preflight import changes

GIB = 2**30


def test_linear_fit_and_the_largest_sizes_that_fit():
    law = LinearPeak(base=3e9, per_token=2e4, per_row=5e4)
    points = [(t, r, law(t, r)) for t, r in [(8192, 4096), (16384, 4096), (8192, 8192)]]
    fit = LinearPeak.fit(points)
    assert fit.base == pytest.approx(3e9) and fit.per_token == pytest.approx(2e4) and fit.per_row == pytest.approx(5e4)
    limit = law(100_000, 32768) + 1  # + 1 byte: the fit's rounding
    assert fit.largest_tokens(limit, 32768, 256) == 99_840  # 100,000 rounded down to a multiple of 256
    assert fit.largest_rows(limit, 100_000, 16) == 32768
    assert LinearPeak.fit([(512, 64, 7.0)]) == LinearPeak(7.0)  # one point: a constant


def test_the_limit_is_what_the_process_may_use():
    whole = MemoryLimit(total=140 * GIB, fraction=1.0, free=130 * GIB, reserved=5 * GIB, headroom=2 * GIB)
    assert whole.limit == 133 * GIB and "135.0 GiB free on the device" not in whole.describe()
    capped = MemoryLimit(total=140 * GIB, fraction=0.35, free=130 * GIB, reserved=5 * GIB, headroom=2 * GIB)
    assert capped.limit == pytest.approx(47 * GIB)
    assert "limit 47.0 GiB = 49.0 GiB this process may use (35% of the device's 140.0 GiB" in capped.describe()
    shared = MemoryLimit(total=140 * GIB, fraction=1.0, free=60 * GIB, reserved=4 * GIB, headroom=2 * GIB)
    assert shared.limit == 62 * GIB and "other processes use the rest" in shared.describe()


def test_changes_since_the_last_start():
    before = {"environment": {"torch": "2.11.0", "transformers": "5.17.0"}, "free": 120 * GIB, "fraction": 1.0,
              "peak_bytes": 90 * GIB, "token_budget": 262144}
    now = {"environment": {"torch": "2.12.0", "transformers": "5.17.0"}, "free": 80 * GIB, "fraction": 1.0,
           "peak_bytes": 90.2 * GIB, "token_budget": 262144}
    assert changes(before, now) == ["torch 2.11.0 -> 2.12.0", "free device memory 120.0 GiB -> 80.0 GiB"]
    assert changes(now, now) == []


# ---------------------------------------------------------------- the search, with a stand-in peak counter
@pytest.fixture()
def cpu_line(qwen3_target, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "SMALL_TOKENS", 1024)  # the GPU sizes / 8: seconds on CPU
    from draftline.sizing import workload

    monkeypatch.setattr(workload, "DOC_TOKENS", 256)
    config = TrainConfig()
    config.data.token_budget = 8192
    config.engine.max_query_rows = 1024
    config.engine.head_chunk_rows = 64
    config.model.block_size = 4
    config.topology.q_hs = 2
    config.out = str(tmp_path / "run")
    target_config = load_target_config(qwen3_target)
    drafter_cfg = build_drafter_config(target_config, num_hidden_layers=1, block_size=4)
    layer_ids = drafter_cfg.dflash_config["target_layer_ids"]
    target = TargetFeatures(qwen3_target, layer_ids, device=torch.device("cpu"), dtype=torch.float32)
    spec = RunSpec.standalone(config, ModelSpec.from_configs(target_config, drafter_cfg), torch.device("cpu"))
    worker = build_drafter_worker(spec, Health(local_rank_info(0, "test", torch.device("cpu"))), target=target)
    return spec, target, worker


def _split(spec: RunSpec) -> RunSpec:
    """The same run on a drafter rank of a split line (no target beside it)."""
    return dataclasses.replace(spec, role=Role(0, DRAFTER, 0, 1, 1))


TARGET_LAW = LinearPeak(base=2 * GIB, per_token=40_000)
DRAFTER_LAW = LinearPeak(base=1 * GIB, per_token=60_000, per_row=200_000)
OPTIMIZER_STATE = 0.5 * GIB


@pytest.fixture()
def counter(monkeypatch):
    """Runs each measured pass for real (on CPU) and reports a known linear law of its size."""
    sizes = {"tokens": 0, "rows": 0, "calls": []}
    real_batch, real_blocks = preflight.worst_case_batch, blocks_module.build_blocks

    def batch(tokens, vocab):
        sizes["tokens"], sizes["rows"] = tokens, 0
        return real_batch(tokens, vocab)

    def blocks(batch, anchors, **kwargs):
        sizes["rows"] = len(anchors) * kwargs["block_size"]
        return real_blocks(batch, anchors, **kwargs)

    def measure(_device, fn):
        fn()
        law = DRAFTER_LAW if sizes["rows"] else TARGET_LAW
        first_drafter_pass = sizes["rows"] and not any(rows for _, rows in sizes["calls"])
        sizes["calls"].append((sizes["tokens"], sizes["rows"]))
        # as on a GPU: the first drafter pass allocates the optimizer state, so its peak lacks it
        return law(sizes["tokens"], sizes["rows"]) - (OPTIMIZER_STATE if first_drafter_pass else 0)

    monkeypatch.setattr(preflight, "worst_case_batch", batch)
    monkeypatch.setattr(loss_module, "build_blocks", blocks)  # what the objective's build calls
    monkeypatch.setattr(preflight, "_measure", measure)
    return sizes


def _limit(monkeypatch, limit_bytes, fraction=0.5):
    total = (limit_bytes + 2 * GIB) / fraction
    monkeypatch.setattr(preflight, "memory_limit", lambda device, headroom: MemoryLimit(
        total=total, fraction=fraction, free=total, reserved=0.0, headroom=headroom * GIB))


def test_a_budget_that_fits_is_measured_small_then_verified_once(cpu_line, counter, monkeypatch, capsys):
    spec, target, worker = cpu_line
    _limit(monkeypatch, 100 * GIB)
    result = preflight.preflight_target(spec, target, "rank 0 (test)")
    # a warm-up (not in the fit), two small sizes, a check between them, one verification
    assert counter["calls"] == [(1024, 0), (1024, 0), (2048, 0), (1536, 0), (8192, 0)]
    assert result.peak == pytest.approx(TARGET_LAW(8192))
    counter["calls"].clear()
    before = {k: v.clone() for k, v in worker.drafter.state_dict().items()}
    preflight.preflight_drafter(spec, worker, "rank 0 (test)", result)
    # a warm-up pass (not in the fit), three small sizes, a check at both larger sizes, one verification
    assert counter["calls"] == [(1024, 64), (1024, 64), (1024, 128), (2048, 64), (2048, 128), (8192, 1024)]
    for name, value in worker.drafter.state_dict().items():  # the drafter is as it was
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert not worker.optimizer.state  # and the optimizer as new
    printed = capsys.readouterr().out
    assert ("preflight: target (rank 0 (test)): peak memory at 1,024 and 2,048 tokens (checked at 1,536), extrapolated "
            "to --token-budget 8,192") in printed
    assert "target: fit: 2.0 GiB + 39.1 MiB per 1K tokens; check at 1,536 tokens: measured" in printed
    assert "the fit holds" in printed and "does not hold" not in printed
    assert "preflight: drafter: " in printed and "verifying at that size" in printed and "within the 100.0 GiB limit" in printed
    assert "(50% of the device's" in printed  # the limit quoted is the process's share


def _largest_budget(room: float) -> int:
    """The largest multiple of 256 tokens whose target peak (TARGET_LAW) is within ``room``."""
    return max(b for b in range(256, 8192, 256) if TARGET_LAW(b) <= room)


def test_a_budget_that_does_not_fit_is_refused_from_the_fit_with_what_fits(cpu_line, counter, monkeypatch):
    spec, target, worker = cpu_line
    limit = TARGET_LAW(5000)
    _limit(monkeypatch, limit)
    with pytest.raises(DraftlineError) as info:
        preflight.preflight_target(spec, target, "rank 0 (test)")
    assert counter["calls"] == [(1024, 0), (1024, 0), (2048, 0), (1536, 0)]  # no full-size run, no search
    message = str(info.value)
    best = int(re.search(r"pass --token-budget (\d+)", message).group(1))
    room = limit * (1 - preflight.SUGGESTION_MARGIN)  # a suggestion leaves a margin for the next run
    assert best == _largest_budget(room) and TARGET_LAW(best) <= room < TARGET_LAW(best + 256) and best < 5000
    assert f"needs {TARGET_LAW(8192) / GIB:.1f} GiB (predicted) at --token-budget 8,192" in message
    assert "50% of the device" in message

    # the drafter, colocated: the target's transient peak counts; both budget and rows are offered
    target_result = preflight.PreflightResult("target", 0.0, {}, LinearPeak(0.0, TARGET_LAW.per_token))
    both = LinearPeak(DRAFTER_LAW.base, DRAFTER_LAW.per_token + TARGET_LAW.per_token, DRAFTER_LAW.per_row)
    _limit(monkeypatch, (both(8192, 512) + 1) / (1 - preflight.SUGGESTION_MARGIN))  # + 1 byte: the fit's rounding
    counter["calls"].clear()
    with pytest.raises(DraftlineError) as info:
        preflight.preflight_drafter(spec, worker, "rank 0 (test)", target_result)
    message = str(info.value)
    rows = int(re.search(r"--max-query-rows (\d+) \(at --token-budget 8192\)", message).group(1))
    budget = int(re.search(r"--token-budget (\d+) \(at --max-query-rows 1024\)", message).group(1))
    assert rows == 512 and both(budget, 1024) <= both(8192, 512) + 1 < both(budget + 256, 1024)
    assert "colocated with the target" in message and "--activation-checkpointing" in message
    assert (8192, 1024) not in counter["calls"]


def test_a_refusal_quotes_the_free_memory_when_other_processes_hold_some(cpu_line, counter, monkeypatch):
    spec, target, _ = cpu_line
    free = TARGET_LAW(5000) + 2 * GIB  # the device is 4x larger: other processes hold the rest
    monkeypatch.setattr(preflight, "memory_limit", lambda device, headroom: MemoryLimit(
        total=4 * free, fraction=1.0, free=free, reserved=0.0, headroom=headroom * GIB))
    with pytest.raises(DraftlineError) as info:
        preflight.preflight_target(spec, target, "rank 0 (test)")
    message = str(info.value)
    assert (f"limit {TARGET_LAW(5000) / GIB:.1f} GiB = {free / GIB:.1f} GiB this process may use ({free / GIB:.1f} GiB "
            "free on the device + 0.0 GiB this process holds; other processes use the rest)") in message, message
    assert f"{4 * free / GIB:.1f} GiB" not in message  # not the whole device
    assert f"pass --token-budget {_largest_budget(TARGET_LAW(5000) * (1 - preflight.SUGGESTION_MARGIN))}" in message


def test_a_one_time_allocation_in_a_measured_point_is_caught_by_the_check(cpu_line, counter, monkeypatch, capsys):
    """As on the H200 before the warm-up (188.6 GiB predicted at 32K): one measured point carries memory the
    others find resident, the slopes carry it. The check point disagrees, so there is no refusal from the
    fit: the configured size is measured, and it fits."""
    spec, target, worker = cpu_line
    _limit(monkeypatch, 5 * GIB)
    counted, polluted = preflight._measure, []

    def measure(device, fn):
        peak = counted(device, fn)
        if counter["calls"][-1] == (2048, 64) and not polluted:  # e.g. kernels compiled for a new shape, kept
            polluted.append(True)
            peak += 2 * GIB
        return peak

    monkeypatch.setattr(preflight, "_measure", measure)
    measured = preflight.preflight_drafter(_split(spec), worker, "rank 0 (test)").measured  # a split line's drafter
    assert LinearPeak(**measured["fit"])(8192, 1024) > 5 * GIB  # the fit alone would have refused
    assert measured["check"]["tokens"] == 2048 and measured["check"]["rows"] == 128 and not measured["check"]["trusted"]
    assert counter["calls"][-1] == (8192, 1024)  # measured at the configured size instead
    assert measured["verified"] == pytest.approx(DRAFTER_LAW(8192, 1024))
    printed = capsys.readouterr().out
    assert "the fit does not hold (a one-time allocation in a measured point" in printed
    assert "within the 5.0 GiB limit" in printed


def test_a_fit_that_does_not_hold_refuses_only_from_the_configured_size(cpu_line, counter, monkeypatch):
    """The same one-time allocation, but the configured size really does not fit: measured there, refused."""
    spec, target, worker = cpu_line
    _limit(monkeypatch, DRAFTER_LAW(8192, 512))
    counted, polluted = preflight._measure, []

    def measure(device, fn):
        peak = counted(device, fn)
        if counter["calls"][-1] == (2048, 64) and not polluted:
            polluted.append(True)
            peak += 2 * GIB
        return peak

    monkeypatch.setattr(preflight, "_measure", measure)
    with pytest.raises(DraftlineError) as info:
        preflight.preflight_drafter(_split(spec), worker, "rank 0 (test)")
    assert counter["calls"][-1] == (8192, 1024)
    assert f"needs {DRAFTER_LAW(8192, 1024) / GIB:.1f} GiB for its worst case" in str(info.value)  # measured, not predicted
    assert "(predicted)" not in str(info.value)


def test_a_resume_says_what_changed(cpu_line, counter, monkeypatch, capsys):
    spec, target, _ = cpu_line
    spec.config.data.token_budget = 2048  # measured directly: one pass
    _limit(monkeypatch, 100 * GIB)
    preflight.preflight_target(spec, target, "rank 0 (test)")
    assert (spec.run_dir / "preflight" / "rank-0.json").is_file()
    assert "since the previous start" not in capsys.readouterr().out  # the first start compares with nothing
    spec.config.data.token_budget = 1024
    _limit(monkeypatch, 60 * GIB)
    capsys.readouterr()
    preflight.preflight_target(spec, target, "rank 0 (test)")
    printed = capsys.readouterr().out
    assert f"target: since the previous start in {spec.run_dir}: " in printed
    assert "free device memory 204.0 GiB -> 124.0 GiB" in printed and "token_budget 2048 -> 1024" in printed


# ---------------------------------------------------------------- the +200 MB day, with the device's readings faked
def test_memory_taken_after_the_plan_is_seen_at_start(cpu_line, counter, monkeypatch):
    """The seeds' worst day: a configuration planned to fit the card by 100 MB, then 200 MB of the device taken
    by something else (a larger library, another process). With --gpu-memory-gib the card's whole use is
    bounded, so preflight's limit moves down by what lies outside the allocator now: the run is refused at start
    with the rows that fit, and those rows fit what is left; it never reaches its first optimizer step."""
    from draftline.distributed import memory
    from helpers import FakeDevice

    spec, _, worker = cpu_line
    spec = _split(spec)
    headroom = spec.config.engine.memory_headroom_gib * GIB
    need = DRAFTER_LAW(8192, 1024)  # the worst case at the configured sizes
    device = FakeDevice(monkeypatch, total=139.81 * GIB, outside=0.75 * GIB)
    card = (need + 0.75 * GIB + headroom + 100 * 2**20) / GIB  # the plan: fits the card by 100 MB
    memory.cap_device(torch.device("cpu"), card)
    assert preflight.preflight_drafter(spec, worker, "rank 0 (test)").peak == pytest.approx(need)

    device.outside += 200 * 2**20  # after the plan: 200 MB more outside this process's allocator
    counter["calls"].clear()
    with pytest.raises(DraftlineError) as info:
        preflight.preflight_drafter(spec, worker, "rank 0 (test)")
    message = str(info.value)
    assert (8192, 1024) not in counter["calls"]  # refused from the fit, before any pass at the configured size
    assert f"--gpu-memory-gib {card:g} of the device less 0.95 GiB outside the allocator" in message, message
    rows = int(re.search(r"--max-query-rows (\d+) \(at --token-budget 8192\)", message).group(1))
    assert rows < 1024 and device.cap == pytest.approx(card * GIB - device.outside)
    spec.config.engine.max_query_rows = rows  # the fix it names fits what is left of the card
    assert preflight.preflight_drafter(spec, worker, "rank 0 (test)").peak <= device.cap - headroom


# ---------------------------------------------------------------- on a GPU, measured for real
def _gpu_line(tmp_path, budget, rows=2048):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device("cuda")
    config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                         tie_word_embeddings=False)
    config._attn_implementation = "flex_attention"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    drafter_cfg = build_drafter_config(config, num_hidden_layers=1, block_size=16)
    layer_ids = drafter_cfg.dflash_config["target_layer_ids"]
    target = TargetFeatures.from_model(model, layer_ids)
    train = TrainConfig()
    train.data.token_budget = budget
    train.engine.max_query_rows = rows
    train.engine.memory_headroom_gib = 0.25
    train.out = str(tmp_path / "run")
    spec = RunSpec.standalone(train, ModelSpec.from_configs(config, drafter_cfg), device)
    worker = build_drafter_worker(spec, Health(local_rank_info(0, "test", device)), target=target)
    return spec, target, worker


@pytest.mark.gpu
def test_gpu_a_budget_that_fits_is_accepted_and_one_that_does_not_is_refused(tmp_path):
    spec, target, worker = _gpu_line(tmp_path, budget=65536)
    result = preflight.preflight_target(spec, target, "rank 0 (gpu test)")
    preflight.preflight_drafter(spec, worker, "rank 0 (gpu test)", result)
    transient = result.peak - torch.cuda.memory_allocated()
    assert transient > 0
    resident = torch.cuda.memory_allocated()
    total = torch.cuda.mem_get_info()[1]
    try:  # cap the process so that the transient peak at this budget cannot fit: refused, naming what fits
        torch.cuda.set_per_process_memory_fraction((resident + 0.5 * transient + 0.25 * GIB) / total)
        with pytest.raises(DraftlineError) as info:
            preflight.preflight_target(spec, target, "rank 0 (gpu test)")
        message = str(info.value)
        assert "torch.cuda.set_per_process_memory_fraction" in message
        best = int(re.search(r"pass --token-budget (\d+)", message).group(1))
        assert 8192 < best < 65536
        spec.config.data.token_budget = best  # what it offered fits
        preflight.preflight_target(spec, target, "rank 0 (gpu test)")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_fix_a_refusal_names_as_flags():
    """What a script or a test reruns with: the refusal's first fix, as flags."""
    from draftline.sizing.preflight import suggested_flags

    rows = ("preflight: the drafter (rank 0) needs 93.1 GiB for its worst case (--token-budget 16,384, --max-query-rows "
            "8,192, colocated with the target); limit 92.0 GiB. The largest that fit: --max-query-rows 7168 (at "
            "--token-budget 16384) or --token-budget 14080 (at --max-query-rows 8192) or --activation-checkpointing")
    assert suggested_flags(rows) == ["--max-query-rows", "7168"]
    assert suggested_flags("needs 61.0 GiB at --token-budget 32,768 with q_hs 8; ... pass --token-budget 30208, or "
                           "lower --q-hs") == ["--token-budget", "30208"]
    assert suggested_flags("The largest that fit: --activation-checkpointing") == ["--activation-checkpointing"]
    assert suggested_flags("something else") == []


def test_the_model_stands_beside_the_measurement(cpu_line, counter, monkeypatch, capsys):
    """Preflight prints and records the memory model's prediction of the worst case it measures; a spec the model
    cannot read gives no prediction and changes nothing else."""
    spec, target, worker = cpu_line
    _limit(monkeypatch, 100 * GIB)
    result = preflight.preflight_target(spec, target, "rank 0 (test)")
    drafter = preflight.preflight_drafter(spec, worker, "rank 0 (test)", result)
    for measured in (result.measured, drafter.measured):
        model = measured["model"]
        assert model["allocated_gib"] > 0 and model["total_gib"] > model["allocated_gib"]
        assert sum(model["parts"].values()) == pytest.approx(model["allocated_gib"], abs=0.01)
    assert any("target weights" in name for name in drafter.measured["model"]["parts"])  # colocated: with its target
    printed = capsys.readouterr().out
    assert printed.count("the memory model said") == 2
    assert preflight.model_prediction(dataclasses.replace(spec, model=None), "drafter") is None
