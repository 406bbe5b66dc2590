"""A target group: the frozen target split over K CPU ranks (gloo) by transformers' tensor-parallel plans gives, on
every rank of the group, the features of the unsplit target in one process.

Two groups, of 2 and of 3 ranks, are parts of one job of 5 ranks, so each split runs on a process group that is not
the whole job (the other group's ranks take part only in creating it, as drafter ranks would). One packed batch of
several documents, fp32; the reference is ``TargetFeatures`` without a group, in this process. Dense (Qwen3), routed experts split over the
group (Qwen3-MoE, with a dense layer too) and the hybrid Gated DeltaNet family (Qwen3.5, dense and MoE), each with
6 attention heads, 6 KV heads and 6 experts so that 2 and 3 both divide them.
"""

from __future__ import annotations

import pytest
import torch

from draftline.errors import DraftlineError
from draftline.model.target import TargetFeatures, load_target_config
from draftline.model.target_parallel import check_group_size
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
    """The reference: each case's features from the whole target in this process."""
    batch = packed_batch(**_BATCH)
    return {name: TargetFeatures(target_dir, layer_ids, dtype=torch.float32, **options)(batch)
            for name, (target_dir, layer_ids, options) in _cases(targets).items()}


@pytest.mark.parametrize("size", sorted(_GROUPS))
@pytest.mark.parametrize("case", ["qwen3_packed", "qwen3_padded", "qwen3_final_hidden", "qwen3_moe_packed",
                                  "qwen3_5_padded", "qwen3_5_moe_padded"])
def test_a_target_group_gives_the_unsplit_targets_features_on_every_rank(split, unsplit, case, size):
    reference = unsplit[case]
    per_rank = {rank: split[case][rank] for rank in _GROUPS[size]}
    for rank, result in per_rank.items():
        got = result["features"]
        assert got.shape == reference.shape, rank
        error = float((got - reference).abs().max() / reference.abs().max())
        print(f"group of {size}, {case}, rank {rank}: max relative error {error:.2e}, holds {result['held']:.3f}")
        assert error <= 1e-5, (rank, error)
        # Split, not replicated: each rank holds about 1/K of the layers' weights (norms, the Gated DeltaNet's
        # convolution and the routers are whole on every rank).
        assert result["held"] < 1 / size + 0.1, (rank, result["held"])
    first = per_rank[_GROUPS[size][0]]["features"]
    assert all(torch.equal(first, result["features"]) for result in per_rank.values())  # the same on every rank


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
