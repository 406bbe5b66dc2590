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
