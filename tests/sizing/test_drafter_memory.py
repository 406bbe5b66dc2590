"""sizing/drafter_memory.py: the per-layer terms equal what the compiler's partitioner keeps; the step's
accounting against what an H200 measured; the moments of a step (a pass with the gradients of the passes before
it, sharded state, whole-layer recomputation) as the arithmetic says."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from draftline.model.config import build_drafter_config
from draftline.sizing.drafter_memory import (
    ACTIVATIONS, GIB, GRADIENTS, PassSize, TRACE_SIZES, compiled_part, drafter_step, layer_saved, trace_config,
    traced_bytes, trained_params,
)
from draftline.sizing.shapes import DrafterShape


@pytest.mark.parametrize("mode", ["none", "cheap", "mlp"])
def test_per_layer_formula_equals_the_traced_partition(mode):
    """The formula's compiled-halves part of a layer equals what the min-cut partitioner keeps on the traced tiny
    layer (Q = 80, T = 160), the halves' own inputs (layer input, context, RoPE tables, attention output) left out."""
    shape = DrafterShape.of(trace_config())
    size = PassSize.of(5, 16, TRACE_SIZES["T"])
    assert size.query_rows == TRACE_SIZES["Q"]
    traced, entries = traced_bytes(mode, shape, size)
    assert any(is_input for *_, is_input in entries) and not all(is_input for *_, is_input in entries)
    assert traced == pytest.approx(compiled_part(layer_saved(shape, shape.layers[0], size, mode)), rel=0.02), entries


def _qwen3_8b_drafter() -> DrafterShape:
    target = Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False)
    return DrafterShape.of(build_drafter_config(target, num_hidden_layers=5, block_size=16))


# Measured on one H200 (torch 2.11, transformers 5.17): bench/drafter_memory.py --attention flex --iters 10,
# one 3,072-token sample, 512 anchors, head chunks of 2,048 rows; max_memory_allocated over the timed steps
# (docs/benchmarks/2026-12-drafter-memory.md).
MEASURED_8B = {("none", True, "fp32"): 22.80, ("cheap", False, "fp32"): 18.88, ("cheap", False, "bf16"): 14.97}


@pytest.mark.parametrize("setting", sorted(MEASURED_8B))
def test_the_step_against_the_h200(setting):
    mode, head_copy, moments = setting
    memory = drafter_step(_qwen3_8b_drafter(), PassSize.of(512, 16, 3072), recompute=mode, head_chunk_rows=2048,
                          moments=moments, head_copy=head_copy)
    assert memory.peak / GIB == pytest.approx(MEASURED_8B[setting], rel=0.015)
    assert sum(b for _, b in memory.components().values()) == memory.peak


def test_the_moments_of_a_step():
    shape = _qwen3_8b_drafter()
    size = PassSize.of(2048, 16, 32768)
    P = trained_params(shape)
    assert 1.04e9 < P < 1.06e9
    alone = drafter_step(shape, size)
    later = drafter_step(shape, size, gradients_held=True)
    # a later pass of the step: the gradients are there through its forward, and its backward adds none
    assert later.forward_end == alone.forward_end + 4 * P
    assert later.backward_end == alone.backward_end
    # at 32,768 rows the backward's first layer (all activations, the MLP's working set) is the peak, 4P higher
    assert alone.peak == alone.backward and later.peak == later.backward == alone.backward + 4 * P
    assert later.components()["fp32 gradients of the step's earlier passes"] == (GRADIENTS, 4 * P)
    # the cheaper modes keep less; mlp drops gate and up ([Q, I] bf16 each) per layer
    none, mlp = drafter_step(shape, size, recompute="none"), drafter_step(shape, size, recompute="mlp")
    assert none.layers_kept > alone.layers_kept > mlp.layers_kept
    assert alone.layers_kept - mlp.layers_kept == 5 * 2 * 2 * size.query_rows * 12288
    # sharded over 4: a quarter of the state, no autocast copies, two layers' bf16 weights and fc gathered
    four = drafter_step(shape, size, recompute="none", num_shards=4, frozen_weights=False)
    assert four.fixed["fp32 master weights"][1] == 4 * P // 4
    assert "bf16 copies of the layer's weights" in four.per_layer[0] and four.per_layer[0]["bf16 copies of the layer's weights"] == 0
    # whole layers recomputed: each keeps its input only
    ckpt = drafter_step(shape, size, activation_checkpointing=True)
    assert ckpt.layers_kept == 5 * 2 * size.query_rows * 4096 and ckpt.peak < alone.peak
    assert any(category == ACTIVATIONS for category, _ in ckpt.components().values())
    with pytest.raises(ValueError, match="moments"):
        drafter_step(shape, size, moments="fp16")
