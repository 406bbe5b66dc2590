"""Target groups in the plan: one rank's share and the link traffic by hand, the group's rate, and the plans of two
targets that fit no GPU whole (Llama-3.3-70B, Qwen3-235B-A22B: their public config.json, tests/sizing/configs/) on
8 x RTX PRO 6000 and 8 x H200."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from draftline.cli import main
from draftline.model.target_parallel import EXPERTS, TENSOR
from draftline.sizing.peak import gpu_spec
from draftline.sizing.plan import RoleRates, group_rates
from draftline.sizing.shapes import TargetShape
from draftline.sizing.target_groups import group_traffic, link_kind, rank_shape

CONFIGS = Path(__file__).parent / "configs"
HEADROOM_GIB = 2.0  # plan's default --memory-headroom-gib


def _dense():
    return LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                       intermediate_size=4096, num_hidden_layers=4, vocab_size=1000)


def _moe():
    return Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=128, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                          num_hidden_layers=3, vocab_size=300)


def test_one_ranks_share_of_a_dense_target_and_its_all_reduces_by_hand():
    config = _dense()
    shape = TargetShape.of(config)
    half = rank_shape(shape, config, 2)
    layer, whole = half.layers[0], shape.layers[0]
    assert (layer.mixer_params, layer.mlp_params, layer.heads, layer.kv_heads) == (
        whole.mixer_params // 2, whole.mlp_params // 2, 4, 4)
    assert half.vocab_size == 500 and half.params() * 2 == shape.params()  # embedding and head split by rows too
    # Two layers run: 2 all-reduces each and one for the embedding, of [tokens, 1024] bf16; a ring moves 2(K-1)/K.
    two = group_traffic(shape, config, 2, 2)
    assert (two.kind, two.all_reduces, two.gathers) == (TENSOR, 5, 0) and two.bytes_per_token == 5 * 1 * 1024 * 2
    assert group_traffic(shape, config, 2, 4).bytes_per_token == 5 * 1.5 * 1024 * 2
    assert group_traffic(shape, config, 2, 1).bytes_per_token == 0 and rank_shape(shape, config, 1) is shape
    assert (link_kind(40.0), link_kind(360.0)) == ("PCIe", "NVLink")


def test_a_moe_target_split_by_its_experts_alone_keeps_the_rest_whole():
    config = _moe()  # 2 KV heads do not divide by 3; 6 experts do
    shape = TargetShape.of(config)
    third = rank_shape(shape, config, 3)
    expert = 3 * 64 * 32
    layer, whole = third.layers[0], shape.layers[0]
    assert layer.mixer_params == whole.mixer_params and layer.heads == whole.heads and third.vocab_size == 300
    assert whole.mlp_params - layer.mlp_params == 2 * expert - 2 * expert // 3  # 2 of 6 run per token, a third here
    assert whole.stored_mlp_params - layer.stored_mlp_params == 6 * expert - 2 * expert
    traffic = group_traffic(shape, config, 3, 3)
    assert (traffic.kind, traffic.all_reduces) == (EXPERTS, 3) and traffic.bytes_per_token == pytest.approx(
        3 * 2 * 2 / 3 * 64 * 2)


def test_a_groups_rate_is_its_share_of_the_compute_plus_its_link_time():
    rates = RoleRates(target_samples_s=2.0, drafter_samples_s=5.0, source="test")
    traffic = group_traffic(TargetShape.of(_dense()), _dense(), 2, 2)  # 10,240 bytes per token
    per_gpu, link_share = group_rates(rates, 2, flops_whole=2.0, flops_rank=1.0, traffic=traffic, mean_length=1000,
                                      link_gbs=1.0)
    group_s = 0.5 / 2.0 + 10240 * 1000 / 1e9
    assert per_gpu.target_samples_s == pytest.approx(1 / (2 * group_s)) and per_gpu.drafter_samples_s == 5.0
    assert link_share == pytest.approx(10240 * 1000 / 1e9 / group_s)
    assert group_rates(rates, 1, 2.0, 2.0, traffic, 1000, 1.0) == (rates, 0.0)


def _plan(tmp_path, name, gpu, *extra):
    target = tmp_path / name
    target.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", target / "config.json")
    out = tmp_path / f"{name}.json"
    assert main(["plan", "--target", str(target), "--gpus", "8", "--gpu", gpu, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("gpu, link", [("RTX PRO 6000", "PCIe"), ("H200", "NVLink")])
@pytest.mark.parametrize("name", ["llama-3.3-70b-instruct", "qwen3-235b-a22b"])
def test_a_target_that_fits_no_gpu_whole_is_planned_in_groups_that_fit(tmp_path, capsys, name, gpu, link):
    """The recommended layout fits every GPU (the table's memory less preflight's headroom) with its rate; on the 96 GB
    card it splits the target over a group; every group layout that fits states what its all-reduces move over which
    link."""
    plan = _plan(tmp_path, name, gpu)
    printed = capsys.readouterr().out
    assert plan["hardware"]["link"] == link and f"({link}; assumed from the GPU's interconnect)" in printed
    best = plan["recommended"]
    assert best["fits"] and max(best["memory_gib"].values()) <= gpu_spec(gpu).memory_gib - HEADROOM_GIB
    assert best["ktok_s"] > 1.0
    whole = [layout for layout in plan["layouts"] if layout["target_parallel"] == 1]
    if gpu == "RTX PRO 6000":  # 141 GB (70B) or 470 GB (235B) of bf16 weights: no 96 GB GPU holds either whole
        assert not any(layout["fits"] for layout in whole)
        assert "no layout fits with a whole target per GPU: a target group splits it" in printed
        assert best["target_parallel"] > 1
    groups = [layout for layout in plan["layouts"] if layout["target_parallel"] > 1 and layout["fits"]]
    assert groups and (best["target_parallel"] == 1 or {k: v for k, v in best.items() if k != "command"} in groups)
    for layout in groups:
        traffic = layout["link_traffic"]
        assert traffic["all_reduces_per_forward"] > 0 and traffic["mb_per_token"] > 0 and traffic["gb_s_per_gpu"] > 0
        assert 0 < traffic["share_of_target_time"] < 1
    if best["target_parallel"] > 1:
        assert f"--target-parallel {best['target_parallel']} " in best["command"]
    print(name, gpu, json.dumps(best))


def test_qwen3_235b_on_rtx_pro_6000_splits_by_its_experts_over_eight(tmp_path, capsys):
    """Its 4 KV heads split over 2 or 4 ranks at most, and a quarter of it (110 GB) fills no 96 GB GPU: 8 ranks hold
    its experts, the attention whole on each."""
    best = _plan(tmp_path, "qwen3-235b-a22b", "RTX PRO 6000")["recommended"]
    assert best["target_parallel"] == 8 and best["colocated"] and best["link_traffic"]["split"] == EXPERTS
    assert best["link_traffic"]["all_reduces_per_forward"] == 92  # one per MoE layer the feature pass runs


def test_plan_refuses_a_group_size_the_target_cannot_take(tmp_path, capsys):
    target = tmp_path / "llama"
    target.mkdir()
    shutil.copy(CONFIGS / "llama-3.3-70b-instruct.json", target / "config.json")
    assert main(["plan", "--target", str(target), "--gpus", "8", "--target-parallel", "3"]) == 2
    assert "64 attention heads, 8 key/value heads" in capsys.readouterr().err
    assert main(["plan", "--target", str(target), "--gpus", "8", "--target-parallel", "2", "--measure"]) == 2
    assert "drop --measure" in capsys.readouterr().err
