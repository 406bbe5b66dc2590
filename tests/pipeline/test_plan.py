"""Planning a topology: the split arithmetic, and the command on a tiny target."""

from __future__ import annotations

import pytest

from draftline.cli import main
from draftline.pipeline.plan import RoleRates, colocated_rate, splits


def test_best_split_balances_the_two_sides():
    rates = RoleRates(target_samples_s=10.0, drafter_samples_s=5.0, source="test")
    table = splits(6, rates)
    best = table[0]
    assert (best.targets, best.drafters) == (2, 4) and best.waiting_side == "none" and best.samples_s == 20.0
    by_split = {(s.targets, s.drafters): s for s in table}
    assert by_split[(5, 1)].waiting_side == "targets" and by_split[(5, 1)].waiting_share == pytest.approx(0.9)
    assert by_split[(1, 5)].waiting_side == "drafters" and by_split[(1, 5)].samples_s == 10.0


def test_colocated_matches_a_balanced_split_and_beats_an_unbalanced_one():
    rates = RoleRates(target_samples_s=10.0, drafter_samples_s=5.0, source="test")
    assert colocated_rate(6, rates) == pytest.approx(splits(6, rates)[0].samples_s)  # 2+4 balances exactly
    assert splits(5, rates)[0].samples_s == 15.0  # 2+3: the drafters set the pace
    assert colocated_rate(5, rates) == pytest.approx(5 / 0.3)


def test_plan_command_estimates_and_measures(qwen3_target, line_data, capsys):
    assert main(["plan", "--target", str(qwen3_target), "--gpus", "8", "--draft-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "recommended: --" in out and "FLOP model" in out and "colocated on every GPU" in out
    assert main(["plan", "--target", str(qwen3_target), "--data", str(line_data), "--gpus", "3", "--measure",
                 "--token-budget", "512", "--draft-layers", "1", "--block-size", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "measured on cpu" in out and out.count("idle") + out.count("balanced") >= 2


def _qwen3_6_27b_config_only(path):
    """Qwen3.6-27B's text config.json and nothing else: planning reads no weights."""
    from transformers import Qwen3_5TextConfig

    Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ).save_pretrained(path)
    return path


def _recommended(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("recommended:"))


def test_plan_for_a_27b_hybrid_on_8_gpus_of_96_and_141_gib(tmp_path, capsys):
    target = _qwen3_6_27b_config_only(tmp_path / "q27")
    assert main(["plan", "--target", str(target), "--gpus", "8", "--gpu", "RTX PRO 6000"]) == 0
    small = capsys.readouterr().out
    assert "8 x NVIDIA RTX PRO 6000 Blackwell: 504 TFLOP/s dense bf16, 96 GiB each" in small
    assert "runs 62 (47 linear attention, 15 full attention)" in small
    assert main(["plan", "--target", str(target), "--gpus", "8", "--gpu-memory-gib", "141",
                 "--gpu-peak-tflops", "989"]) == 0
    large = capsys.readouterr().out
    # 96 GiB: target (~49 GiB of bf16 weights) and drafter (~32 GiB of weights and AdamW state) share a GPU
    # only at a small budget, so the split wins; 141 GiB: they share one at 32K.
    assert "colocated at --token-budget 8192" in small
    assert _recommended(small).startswith("recommended: --targets 4 --drafters 4 --token-budget 32768")
    assert _recommended(large).startswith("recommended: --colocated --token-budget 32768")
    # The linear-attention layers cost the same per token at any length; the full-attention ones grow.
    assert "target 132 TFLOP" in small and "target 132 TFLOP" in large


def test_plan_memory_model_by_hand():
    from draftline.monitor.flops import DrafterShape, TargetShape
    from draftline.pipeline.plan import drafter_memory, target_memory

    target = TargetShape.uniform(hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128, intermediate_size=4096,
                                 num_layers=4, vocab_size=1000)
    memory = target_memory(target, layers_run=2, token_budget=1000, num_feature_layers=2, queued_batches=1)
    layer = 4 * 1024 * 1024 + 3 * 1024 * 4096  # q, k, v, o + SwiGLU
    assert memory.weights * 2**30 == 2 * (2 * layer + 2 * 1000 * 1024)  # bf16, embedding and head included
    assert memory.buffers * 2**30 == 2 * 1000 * 2 * 1024 * 2  # this batch's features and one queued
    drafter = DrafterShape.uniform(hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128,
                                   intermediate_size=4096, num_layers=1, vocab_size=1000, target_layer_ids=(0, 1))
    trained = layer + 2 * 1024 * 1024  # one layer + fc
    d = drafter_memory(drafter, token_budget=1000, max_query_rows=64, queued_batches=0)
    assert d.optimizer * 2**30 == 8 * trained and d.weights * 2**30 == 8 * trained + 2 * 2 * 1000 * 1024
