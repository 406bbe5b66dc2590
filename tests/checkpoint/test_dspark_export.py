"""The DSpark export: DeepSpec's top-level layout, read back exactly, loaded by SpecForge's DSpark model with
every tensor matched, and the model card's commands."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.checkpoint.model_card import model_card, serving_commands
from draftline.checkpoint.serving import check_drafter_dir
from draftline.errors import DraftlineError
from draftline.model.dspark import DSparkDrafter
from draftline.model.target import load_target_config
from helpers import make_dspark_drafter


def export(target_dir, path, **options):
    """A 2-layer block-7 DSpark drafter for the 8-layer qwen3 test target (hidden 64, vocab 320), exported."""
    drafter = make_dspark_drafter(load_target_config(target_dir), block_size=7, markov_rank=16,
                                  target_layer_ids=(1, 5), **options)
    return drafter, save_drafter(drafter, path, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_layout_round_trip_and_the_serving_check(qwen3_target, tmp_path, kind):
    drafter, path = export(qwen3_target, tmp_path / "drafter", markov_head_type=kind)
    data = json.loads((path / "config.json").read_text())
    assert data["architectures"] == ["Qwen3DSparkModel"] and data["model_type"] == "qwen3"
    assert "dflash_config" not in data
    assert {k: data[k] for k in ("block_size", "num_target_layers", "target_layer_ids", "mask_token_id", "markov_rank",
                                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")} == {
        "block_size": 7, "num_target_layers": 8, "target_layer_ids": [1, 5], "mask_token_id": 319, "markov_rank": 16,
        "markov_head_type": kind, "enable_confidence_head": True, "confidence_head_with_markov": True}
    tensors = load_file(path / "model.safetensors")
    heads = {n: tuple(t.shape) for n, t in tensors.items() if n.startswith(("markov", "confidence"))}
    expected = {"markov_head.markov_w1.weight": (320, 16), "markov_head.markov_w2.weight": (320, 16),
                "confidence_head.proj.weight": (1, 80), "confidence_head.proj.bias": (1,)}
    if kind == "gated":
        expected.update({"markov_head.gate_proj.weight": (16, 80), "markov_head.gate_proj.bias": (16,)})
    assert heads == expected
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in tensors)

    loaded = load_drafter(path)
    assert isinstance(loaded, DSparkDrafter) and loaded.config.markov_head_type == kind
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    warnings = check_drafter_dir(path, qwen3_target)
    assert (any("does not serve this drafter" in w for w in warnings)) == (kind == "gated")


def test_a_missing_top_level_field_or_a_dflash_config_is_named(qwen3_target, tmp_path):
    _, path = export(qwen3_target, tmp_path / "drafter")
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k != "markov_rank"}))
    with pytest.raises(DraftlineError, match="'markov_rank' missing"):
        load_drafter(path)
    (path / "config.json").write_text(json.dumps({**data, "dflash_config": {"mask_token_id": 3}}))
    with pytest.raises(DraftlineError, match="remove it"):
        load_drafter(path)


@pytest.mark.parametrize("kind,with_markov", [("vanilla", True), ("gated", False)])
def test_the_export_loads_into_specforges_dspark_model(qwen3_target, tmp_path, kind, with_markov):
    """SpecForge's DSparkDraftModel, built from the exported config (its heads' fields in its dflash_config),
    takes every tensor of model.safetensors by name, strictly, and nothing is left over."""
    peer = pytest.importorskip("specforge.modeling.draft.dspark",
                               reason="specforge==0.2.0 --no-deps (make test installs it)")
    from draftline.checkpoint.export import load_drafter_config
    from dspark_reference import specforge_config

    drafter, path = export(qwen3_target, tmp_path / "drafter", markov_head_type=kind, with_markov=with_markov)
    tensors = load_file(path / "model.safetensors")
    theirs = peer.DSparkDraftModel(specforge_config(load_drafter_config(path))).float()
    result = theirs.load_state_dict(tensors, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert set(theirs.state_dict()) == set(tensors)
    assert torch.equal(theirs.markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)


def test_model_card_commands(qwen3_target, tmp_path):
    drafter, _ = export(qwen3_target, tmp_path / "drafter")
    commands = serving_commands(drafter.config, drafter="D", target="T")
    assert commands["sglang"] == ("python -m sglang.launch_server --model-path T --speculative-algorithm DSPARK "
                                  "--speculative-draft-model-path D --speculative-num-draft-tokens 8")
    assert commands["vllm"] == ("vllm serve T --speculative-config "
                                "'{\"method\": \"dspark\", \"model\": \"D\", \"num_speculative_tokens\": 7}'")
    card = model_card(drafter.config, target_name="tiny", num_parameters=123_000)
    assert card.startswith("# DSpark drafter") and "--speculative-algorithm DSPARK" in card
    assert '\\"method\\": \\"dspark\\", \\"model\\": \\"$DRAFTER\\"' in card  # vLLM's JSON, $DRAFTER expanded
    gated, _ = export(qwen3_target, tmp_path / "gated", markov_head_type="gated")
    card = model_card(gated.config, target_name="tiny", num_parameters=1)
    assert "vllm serve" not in card and "vLLM does not serve this drafter" in card
    assert serving_commands(gated.config)["vllm"].startswith("(vLLM does not serve")
