"""The method seam: a name or a saved drafter resolves to its method, and each method's pieces fit together
(config -> drafter -> objective -> a training step -> export -> load -> decoding) through the same calls."""

from __future__ import annotations

import pytest
import torch

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.data.batch import PackedBatch
from draftline.evaluate.speculative import DFlashProposer, speculative_generate, target_generate
from draftline.methods import METHODS, get_method, method_for
from draftline.methods.dspark import DSpark
from draftline.model.config import build_drafter_config
from draftline.model.dspark import DSparkDrafter
from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config
from draftline.objective.dspark import DSparkLoss, DSparkObjective
from draftline.objective.loss import DFlashObjective, ObjectiveSettings


def test_names_resolve_and_unknown_names_are_refused():
    assert [get_method(name).name for name in METHODS] == ["dflash", "dspark"]
    with pytest.raises(ValueError, match="dflash, dspark"):
        get_method("domino")


def test_a_config_says_its_method(qwen3_target):
    base = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)
    dspark = get_method("dspark").build_config(base)
    assert method_for(base).name == "dflash" and method_for(dspark).name == "dspark"
    assert method_for(dspark.to_dict()).name == "dspark"
    assert get_method("dflash").build_config(base) is base


def test_options_reach_the_heads_and_the_loss(qwen3_target):
    method = DSpark(markov_rank=8, markov_head_type="gated", confidence_head=False, loss=DSparkLoss(l1_weight=0.5))
    base = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    drafter = method.build_drafter(method.build_config(base))
    assert drafter.markov_head.kind == "gated" and drafter.confidence_head is None
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float32)
    objective = method.objective(drafter, embed, head, ObjectiveSettings(attention="dense"))
    assert isinstance(objective, DSparkObjective) and objective.loss.l1_weight == 0.5


@pytest.mark.parametrize("name", METHODS)
def test_each_method_trains_exports_and_decodes_through_the_seam(name, qwen3_target, qwen3_model, tmp_path):
    method = get_method(name)
    base = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    config = method.build_config(base)
    torch.manual_seed(0)
    drafter = method.build_drafter(config).float()
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float32)
    settings = ObjectiveSettings(max_anchors=8, attention="dense")
    objective = method.objective(drafter, embed, head, settings)
    assert isinstance(objective, DSparkObjective if name == "dspark" else DFlashObjective)
    assert objective.first_slot == method.first_slot
    width = len(drafter.target_layer_ids) + method.needs_final_hidden(settings)
    assert objective.feature_width == width * config.hidden_size

    prompt = [17, 5, 230, 44, 91, 8]
    ids = target_generate(qwen3_model, prompt, max_new_tokens=20).output_ids
    batch = PackedBatch.from_documents([(ids, [i >= len(prompt) for i in range(len(ids))])])
    features = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32,
                              final_hidden=method.needs_final_hidden(settings))(batch)
    (part, blocks), = objective.passes(batch, 64, dense=True)
    loss_sum, metrics = objective(features[part.token_lo:part.token_hi], blocks)
    loss_sum.backward()
    assert metrics.shape == (objective.metrics_size,) and torch.isfinite(loss_sum)
    assert all(p.grad is not None for p in drafter.parameters())
    summary = objective.summarize(metrics)
    assert len(summary["accuracy_by_position"]) == method.drafts_per_block(4)

    loaded = load_drafter(save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32))
    assert type(loaded) is type(drafter) and method_for(loaded.config).name == name
    proposer = method.proposer(loaded.eval(), qwen3_model)
    assert isinstance(proposer, DFlashProposer)  # DSpark's proposer runs DFlash's backbone step, then its heads
    assert isinstance(loaded, DSparkDrafter) == (name == "dspark")
    out = speculative_generate(qwen3_model, proposer, prompt, max_new_tokens=10)
    assert out.output_ids == ids[: len(prompt) + 10]
    assert max(out.acceptance_lengths) <= method.drafts_per_block(4) + 1
    assert "sglang" in method.serving_commands(config) and "vllm" in method.serving_commands(config)
