"""A step's loss and gradients do not depend on how it is split into micro-batches."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.objective.metrics import WEIGHT_SUM


def _docs(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(8, 30, (1,), generator=g))
        out.append((torch.randint(0, 300, (length,), generator=g).tolist(), [j > 2 for j in range(length)]))
    return out


def _grads_and_loss(objective, target, batches):
    drafter = objective.drafter
    drafter.zero_grad()
    total_weight = 0.0
    total_loss = 0.0
    for batch in batches:
        blocks = objective.blocks(batch)
        loss_sum, metrics = objective(target(batch), blocks)
        loss_sum.backward()
        total_weight += float(metrics[WEIGHT_SUM])
        total_loss += float(loss_sum)
    return total_loss / total_weight, {n: p.grad / total_weight for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_split_invariance(qwen3_target, loss):
    """Also for D-PACE, whose normaliser (the step's label count) is the same however the step is split."""
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double()
    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float64)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float64)
    settings = ObjectiveSettings(max_anchors=5, seed=1, head_chunk_rows=7, loss=loss)
    objective = DFlashObjective(drafter, embed, head, settings)
    docs = _docs(6, seed=2)
    ids = list(range(6))
    whole = [PackedBatch.from_documents(docs, sample_ids=ids)]
    split = [PackedBatch.from_documents(docs[:1], sample_ids=ids[:1]),
             PackedBatch.from_documents(docs[1:4], sample_ids=ids[1:4]),
             PackedBatch.from_documents(docs[4:], sample_ids=ids[4:])]
    loss_a, grads_a = _grads_and_loss(objective, target, whole)
    loss_b, grads_b = _grads_and_loss(objective, target, split)
    assert abs(loss_a - loss_b) < 1e-10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_passes_of_a_batch_add_up_to_its_one_pass_loss(qwen3_target, loss):
    """``DFlashObjective.passes`` (what the drafter worker trains on) splits a batch into passes whose
    losses and label weights add up to the one-pass ``blocks`` of the same batch."""
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double()
    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float64)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float64)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=5, seed=1, loss=loss))
    batch = PackedBatch.from_documents(_docs(5, seed=3), sample_ids=list(range(5)))
    features = target(batch)
    with torch.no_grad():
        whole, whole_metrics = objective(features, objective.blocks(batch))
        parts = list(objective.passes(batch, max_anchors_per_pass=3, dense=True))
        assert len(parts) > 2
        results = [objective(features[p.token_lo : p.token_hi], blocks) for p, blocks in parts]
    assert sum(p.anchors.numel() for p, _ in parts) == objective.blocks(batch).num_anchors
    torch.testing.assert_close(sum(r[0] for r in results), whole, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(sum(float(r[1][WEIGHT_SUM]) for r in results), float(whole_metrics[WEIGHT_SUM]))


def test_dpace_normalises_by_the_label_count_and_weighs_early_slots_more(qwen3_target):
    """D-PACE's pass carries the count of its labels as its weight (the step's normaliser), and its loss is not
    the DFlash loss of the same blocks."""
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double()
    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float64)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float64)
    batch = PackedBatch.from_documents(_docs(4, seed=5), sample_ids=list(range(4)))
    features = target(batch)
    results = {}
    for loss in ("dflash", "dpace"):
        objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=5, seed=1, loss=loss))
        blocks = objective.blocks(batch)
        with torch.no_grad():
            results[loss] = objective(features, blocks), blocks
    (dpace_sum, dpace_metrics), blocks = results["dpace"]
    (dflash_sum, _), _ = results["dflash"]
    assert float(dpace_metrics[WEIGHT_SUM]) == blocks.labels.numel()
    assert not torch.allclose(dpace_sum, dflash_sum)
