"""bench/drafter_memory.py: its accounting agrees with what the partitioner keeps, and its variants run.

Run by hand beside the script: pytest bench/test_drafter_memory.py"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import drafter_memory as dm  # noqa: E402
from workloads import target_config  # noqa: E402

from draftline.model.config import build_drafter_config  # noqa: E402


@pytest.mark.parametrize("mode", ["none", "cheap", "mlp"])
def test_per_layer_formula_equals_the_traced_partition(mode):
    """The formula's compiled-halves part of a layer equals what the min-cut partitioner keeps on the traced tiny
    layer (Q = 80, T = 160), the halves' own inputs (layer input, context, RoPE tables, attention output) left out."""
    cfg = build_drafter_config(target_config("tiny"), num_hidden_layers=1, block_size=16)
    shape = dm.Shape.of(cfg, 160, 5)
    traced = dm.trace_compiled(mode)
    assert any(is_input for *_, is_input in traced) and not all(is_input for *_, is_input in traced)
    traced_bytes = sum(math.prod(s) * getattr(torch, d).itemsize for _, s, d, is_input in traced if not is_input)
    formula = dm.layer_saved(shape, mode)
    halves = sum(v for k, v in formula.items() if not k.startswith(("attention kernel", "layer output")))
    assert traced_bytes == pytest.approx(halves, rel=0.02), traced


def test_variants_run_on_cpu(capsys):
    """A tiny shape, two steps per variant (the GPU's memory figures are left out on a CPU)."""
    args = types.SimpleNamespace(head_chunk_rows=64, max_query_rows=32768, attention="auto", anchors=8, tokens=200,
                                 warmup=1, iters=1, saved_tensors=True)
    cfg = build_drafter_config(target_config("tiny"), num_hidden_layers=2, block_size=16)
    shape = dm.Shape.of(cfg, 200, 8)
    variants = ["cheap", "none+headcopy", "cheap+bf16moments"] + (["peer"] if importlib.util.find_spec("specforge") else [])
    results = [dm.run_variant(v, args, cfg, torch.device("cpu"), torch.float32, shape) for v in variants]
    ours = [r["losses"] for r in results[:3]]
    assert ours[0] == ours[1] and len(ours[0]) == 2  # same seeds, same batches: the same losses on the CPU path
    assert ours[2][0] == ours[0][0]  # bf16 moments: the same first pass (the updates differ from the second on)
    for r in results:
        assert r["step_ms_median"] > 0 and "layer 1" in r["saved_tensors"]
    dm.print_table(results)
    assert "cheap" in capsys.readouterr().out
