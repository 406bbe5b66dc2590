"""A target group: the frozen target split over K CPU ranks (gloo) by transformers' tensor-parallel plans gives, on
every rank of the group, the features of the unsplit target in one process.

Two groups, of 2 and of 3 ranks, are parts of one job of 5 ranks, so each split runs on a process group that is not
the whole job (the other group's ranks take part only in creating it, as drafter ranks would). One packed batch of
several documents, fp32; the reference is ``TargetFeatures`` without a group, in this process. Dense (Qwen3), routed experts split over the
group (Qwen3-MoE, with a dense layer too) and the hybrid Gated DeltaNet family (Qwen3.5, dense and MoE), each with
6 attention heads, 6 KV heads and 6 experts so that 2 and 3 both divide them; a Qwen3-MoE with 4 heads and 2 KV heads
splits over 2 ranks by its heads and experts and over 3 by its experts alone (its attention whole on each rank); a
Qwen3 with a tied embedding and head. On every rank the embedding and the LM head (what a colocated drafter's
objective and soft labels read) are the whole tensors of the unsplit target.
"""

from __future__ import annotations

import pytest
import torch

from draftline.errors import DraftlineError
from draftline.model.target import TargetFeatures, load_target_config
from draftline.model.target_parallel import EXPERTS, TENSOR, check_group_size, split_kind
from helpers import make_qwen3_5_moe_target, make_qwen3_5_target, make_qwen3_moe_target, make_qwen3_target, packed_batch
from parallel_helpers import group_features

pytestmark = pytest.mark.slow

_SIX = dict(num_attention_heads=6, num_key_value_heads=6, head_dim=16, hidden_size=96)
_EXPERTS = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)


# The hybrids' Gated DeltaNet recurrence at the helpers' weight scale (0.2) is so ill-conditioned that fp32 alone
# is 4e-5 from an fp64 run of the same model; at 0.05 it is 2e-6, so 1e-5 tells a wrong split from rounding.
_CALM = dict(initializer_range=0.05)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("group_targets")
    return {
        "qwen3": make_qwen3_target(root / "qwen3", num_heads=6, num_kv_heads=6, head_dim=16, hidden_size=96,
                                   intermediate_size=192),
        "qwen3_moe": make_qwen3_moe_target(root / "qwen3_moe", **_SIX, **_EXPERTS, mlp_only_layers=[0]),
        "qwen3_5": make_qwen3_5_target(root / "qwen3_5", **_SIX, **_CALM),
        "qwen3_5_moe": make_qwen3_5_moe_target(root / "qwen3_5_moe", **_SIX, **_EXPERTS, **_CALM),
        "qwen3_moe_two_kv": make_qwen3_moe_target(root / "qwen3_moe_two_kv", **_EXPERTS, num_attention_heads=4,
                                                  num_key_value_heads=2),
        "qwen3_tied": make_qwen3_target(root / "qwen3_tied", num_heads=6, num_kv_heads=6, head_dim=16, hidden_size=96,
                                        intermediate_size=192, tie=True, seed=1),
    }


def _cases(targets) -> dict:
    """name -> (target, feature layers, TargetFeatures options): the layer cut (the deepest feature layer is 3 of
    8), one packed row with a per-document mask and one padded row per document, the final hidden state."""
    return {
        "qwen3_packed": (targets["qwen3"], [1, 3], dict(packed=True)),
        "qwen3_padded": (targets["qwen3"], [1, 3], dict(packed=False)),
        "qwen3_final_hidden": (targets["qwen3"], [2], dict(packed=True, final_hidden=True)),
        "qwen3_moe_packed": (targets["qwen3_moe"], [0, 2, 4], dict(packed=True)),
        "qwen3_5_padded": (targets["qwen3_5"], [2, 4], dict(packed=False)),
        "qwen3_5_moe_padded": (targets["qwen3_5_moe"], [1, 3], dict(packed=False)),
        "qwen3_moe_two_kv_packed": (targets["qwen3_moe_two_kv"], [1, 4], dict(packed=True)),
        "qwen3_tied_final_hidden": (targets["qwen3_tied"], [2], dict(packed=True, final_hidden=True)),
    }


_BATCH = dict(lengths=[23, 9, 31, 14], vocab=300, seed=7)


_GROUPS = {2: [0, 1], 3: [2, 3, 4]}


@pytest.fixture(scope="module")
def split(targets, tmp_path_factory):
    """One job of 5 ranks: ranks 0-1 are a group of 2, ranks 2-4 a group of 3."""
    pytest.importorskip("accelerate", reason="transformers' tensor-parallel loading needs accelerate (the test extra)")
    return group_features(tmp_path_factory.mktemp("groups"), 5, list(_GROUPS.values()), _cases(targets),
                          packed_batch(**_BATCH))


@pytest.fixture(scope="module")
def unsplit(targets):
    """The reference: each case's features, embedding and head from the whole target in this process."""
    batch = packed_batch(**_BATCH)
    out = {}
    for name, (target_dir, layer_ids, options) in _cases(targets).items():
        target = TargetFeatures(target_dir, layer_ids, dtype=torch.float32, **options)
        out[name] = {"features": target(batch), "embed": target.embed_weight(), "head": target.head_weight()}
    return out


@pytest.mark.parametrize("size", sorted(_GROUPS))
@pytest.mark.parametrize("case", ["qwen3_packed", "qwen3_padded", "qwen3_final_hidden", "qwen3_moe_packed",
                                  "qwen3_5_padded", "qwen3_5_moe_padded", "qwen3_moe_two_kv_packed",
                                  "qwen3_tied_final_hidden"])
def test_a_target_group_gives_the_unsplit_targets_features_on_every_rank(split, unsplit, case, size):
    reference = unsplit[case]["features"]
    per_rank = {rank: split[case][rank] for rank in _GROUPS[size]}
    experts_only = case == "qwen3_moe_two_kv_packed" and size == 3  # 2 KV heads do not divide by 3; 6 experts do
    for rank, result in per_rank.items():
        got = result["features"]
        assert got.shape == reference.shape, rank
        error = float((got - reference).abs().max() / reference.abs().max())
        print(f"group of {size}, {case}, rank {rank}: max relative error {error:.2e}, holds {result['held']:.3f}")
        assert error <= 1e-5, (rank, error)
        if experts_only:  # the experts split, the attention whole on every rank
            assert result["held_experts"] == pytest.approx(1 / size) and result["held"] > 1 / size + 0.1, result["held"]
        else:
            # Split, not replicated: each rank holds about 1/K of the layers' weights (norms, the Gated DeltaNet's
            # convolution and the routers are whole on every rank).
            assert result["held"] < 1 / size + 0.1, (rank, result["held"])
    first = per_rank[_GROUPS[size][0]]["features"]
    assert all(torch.equal(first, result["features"]) for result in per_rank.values())  # the same on every rank


@pytest.mark.parametrize("case", ["qwen3_packed", "qwen3_moe_two_kv_packed", "qwen3_tied_final_hidden"])
def test_a_split_targets_embedding_and_head_are_whole_on_every_rank(split, unsplit, case):
    """transformers splits the embedding and the LM head by vocabulary rows (DTensors); a colocated drafter's objective
    and soft labels need them whole: each rank of each group hands out the unsplit target's tensors, tied where the
    target ties them."""
    reference = unsplit[case]
    for rank, result in split[case].items():
        assert result["plain"], rank
        assert torch.equal(result["embed"], reference["embed"]) and torch.equal(result["head"], reference["head"]), rank
        assert result["tied"] == (case == "qwen3_tied_final_hidden"), rank


def test_a_moe_target_splits_by_its_experts_where_its_heads_do_not_divide(targets):
    config = load_target_config(targets["qwen3_moe_two_kv"])  # 4 heads, 2 KV heads, 6 experts
    assert [split_kind(config, k) for k in (1, 2, 3, 4, 6)] == [TENSOR, TENSOR, EXPERTS, None, EXPERTS]
    assert check_group_size(config, 3) == EXPERTS
    with pytest.raises(DraftlineError, match=r"2 key/value heads, 6 experts.*Use the target group size 2 or 3 or 6"):
        check_group_size(config, 4)
    assert split_kind(load_target_config(targets["qwen3"]), 4) is None  # dense: the heads must divide


def test_a_group_size_that_does_not_divide_the_heads_is_refused_before_loading(targets):
    config = load_target_config(targets["qwen3"])
    check_group_size(config, 3)
    with pytest.raises(DraftlineError, match=r"6 attention heads, 6 key/value heads.*Use the target group size 2 or 3 or 6"):
        check_group_size(config, 4)
    with pytest.raises(DraftlineError, match=r"6 experts"):
        check_group_size(load_target_config(targets["qwen3_moe"]), 4)


def test_a_split_target_without_accelerate_names_the_install(monkeypatch):
    import importlib.util

    from draftline.model import target_parallel

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(DraftlineError, match="pip install accelerate"):
        target_parallel._require_accelerate()


@pytest.mark.gpu
def test_gpu_a_group_of_two_gpus_gives_the_unsplit_features(targets, tmp_path):
    """Two GPUs (NCCL), fp32, one packed row with flex attention's block mask: each GPU's features equal the whole
    target's on one GPU: dense, MoE (heads and experts split), a tied embedding and head with the final hidden state."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("accelerate")
    cases = {name: case for name, case in _cases(targets).items()
             if name in ("qwen3_packed", "qwen3_moe_packed", "qwen3_tied_final_hidden", "qwen3_moe_two_kv_packed")}
    batch = packed_batch(**_BATCH)
    split = group_features(tmp_path, 2, [[0, 1]], cases, batch, device_type="cuda")
    for name, (target_dir, layer_ids, options) in cases.items():
        reference = TargetFeatures(target_dir, layer_ids, dtype=torch.float32, device="cuda:0", **options)(batch).cpu()
        for rank, result in split[name].items():
            error = float((result["features"] - reference).abs().max() / reference.abs().max())
            print(f"GPU group of 2, {name}, rank {rank}: max relative error {error:.2e}")
            assert error <= 1e-4, (name, rank, error)
        assert torch.equal(split[name][0]["features"], split[name][1]["features"])
