"""bench/bench_line.py's line mode (bench/line_bench.py), on CPU: what the one-H200 run of the 27B-shaped hybrid target relies on.

Preflight's refusals (the real messages of pipeline/preflight.py) are read into the flags they suggest;
the line runs again with them; the saved target's weights are deleted once the line has loaded them;
nothing of a refused attempt stays alive for the next one.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftline.config import TrainConfig
from draftline.errors import DraftlineError
from draftline.pipeline.preflight import SUGGESTION_MARGIN, LinearPeak, MemoryLimit, _refuse_drafter, _refuse_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_line  # noqa: E402
import line_bench  # noqa: E402

GIB = 2**30


def _line(q_hs: int = 2, width: int = 5 * 5120):
    config = TrainConfig()
    config.topology.q_hs = q_hs
    return SimpleNamespace(config=config, feature_width=width, dtype=torch.bfloat16)


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(DraftlineError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _limit(total_gib: float) -> MemoryLimit:
    return MemoryLimit(total=total_gib * GIB, fraction=1.0, free=total_gib * GIB, reserved=0.0, headroom=2 * GIB)


def test_a_drafter_refusal_suggests_fewer_query_rows_at_the_same_budget():
    limit, fit = _limit(139), LinearPeak(base=80 * GIB, per_token=1e6, per_row=2.5e6)
    message = _message(_refuse_drafter, _line(), 32768, 32768, fit(32768, 32768), fit, limit, "rank 0", True,
                       predicted=True)
    rows = min(fit.largest_rows(limit.limit * (1 - SUGGESTION_MARGIN), 32768, 16), 32768 - 16)
    assert 16 <= rows < 32768
    assert line_bench.preflight_suggestion(message) == ["--max-query-rows", str(rows)]


def test_without_a_rows_option_the_budget_then_activation_checkpointing():
    limit = _limit(139)
    tokens_only = LinearPeak(base=100 * GIB, per_token=2e6, per_row=0.0)
    message = _message(_refuse_drafter, _line(), 32768, 32768, tokens_only(32768), tokens_only, limit, "rank 0", True)
    budget = min(tokens_only.largest_tokens(limit.limit * (1 - SUGGESTION_MARGIN), 32768, 256), 32768 - 256)
    assert line_bench.preflight_suggestion(message) == ["--token-budget", str(budget)]

    hopeless = LinearPeak(base=200 * GIB)
    message = _message(_refuse_drafter, _line(), 32768, 32768, hopeless(0), hopeless, limit, "rank 0", True)
    assert line_bench.preflight_suggestion(message) == ["--activation-checkpointing"]

    target = LinearPeak(base=120 * GIB, per_token=1e6)
    message = _message(_refuse_target, _line(), 32768, target(32768), target, limit, "rank 0", predicted=True)
    budget = target.largest_tokens(limit.limit * (1 - SUGGESTION_MARGIN), 0, 256)
    assert line_bench.preflight_suggestion(message) == ["--token-budget", str(budget)]


@pytest.mark.slow
def test_the_line_runs_again_with_what_preflight_suggests(tmp_path, monkeypatch):
    """The tiny hybrid shape through `draftline train` (CPU has no preflight: the first attempt's
    drafter build raises a real refusal message instead)."""
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import TargetFeatures
    from draftline.pipeline import line as line_module

    limit, fit = _limit(12), LinearPeak(base=8 * GIB, per_row=2 * GIB / 1024)
    refusal = _message(_refuse_drafter, _line(width=1280), 1024, 4096, fit(1024, 4096), fit, limit, "rank 0", True)
    rows = min(fit.largest_rows(limit.limit * (1 - SUGGESTION_MARGIN), 1024, 16), 4096 - 16)
    assert 16 <= rows < 4096
    assert line_bench.preflight_suggestion(refusal) == ["--max-query-rows", str(rows)]
    real_build = line_module.Line._build_drafter
    builds = []

    def refuse_first(self, target, setup):
        builds.append(self.config.engine.max_query_rows)
        if len(builds) == 1:
            raise DraftlineError(refusal)
        return real_build(self, target, setup)

    monkeypatch.setattr(line_module.Line, "_build_drafter", refuse_first)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_line.py", "--device", "cpu", "--shape", "tiny-hybrid", "--skip", "target", "drafter-3072",
        "drafter-packed", "--line", "--budget", "1024", "--max-query-rows", "4096", "--line-steps", "1",
        "--line-samples", "8", "--line-log-every", "5", "--line-free-target-disk", "--workdir", str(tmp_path),
        "--json", str(out)])
    assert bench_line.main() == 0

    row = json.loads(out.read_text())["rows"][0]
    first, second = row["attempts"]
    assert first["exit"] == 2 and "preflight: the drafter" in first["refusal"]
    assert second["exit"] == 0 and second["argv"][-2:] == ["--max-query-rows", str(rows)] and builds == [4096, rows]
    assert row["tokens_s"] > 0 and f"--max-query-rows {rows}" in row["note"]
    assert (tmp_path / "target" / "config.json").is_file() and not line_bench._weights(tmp_path / "target")
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) in (TargetFeatures, DFlashDrafter)]
