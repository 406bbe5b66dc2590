"""A step's loss and gradients do not depend on how it is split into micro-batches."""

from __future__ import annotations

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


def test_split_invariance(qwen3_target):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double()
    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float64)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float64)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=5, seed=1, head_chunk_rows=7))
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


def test_passes_of_a_batch_add_up_to_its_one_pass_loss(qwen3_target):
    """``DFlashObjective.passes`` (what the drafter worker trains on) splits a batch into passes whose
    losses and label weights add up to the one-pass ``blocks`` of the same batch."""
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).double()
    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float64)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float64)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=5, seed=1))
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
