"""The DSpark objective against SpecForge 0.2.0's ``OnlineDSparkModel`` (whose loss is DeepSpec's): the same
weights, features, target hidden states and anchors give the same loss, terms, metrics and gradients (fp32)."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.objective.dspark import (BCE_SUM, CE_SUM, CONFIDENCE_ERROR_SUM, L1_SUM, DSparkLoss, DSparkObjective,
                                        summarize_dspark)
from draftline.objective.loss import ObjectiveSettings
from draftline.objective.metrics import LOSS_SUM, WEIGHT_SUM, metrics_size
from helpers import make_dspark_drafter

SEQ, BLOCK, HIDDEN, VOCAB = 22, 4, 32, 64


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (SEQ,), generator=gen)
    mask = torch.ones(SEQ, dtype=torch.bool)
    mask[:3] = False  # the prompt
    mask[11] = False  # a turn boundary inside the response: blocks running into it are cut
    anchors = torch.tensor([3, 5, 8, 9, 12, 16, 19, 20])  # each with loss_mask[p] and loss_mask[p + 1]
    features = torch.randn(SEQ, 2 * HIDDEN, generator=gen)
    final = torch.randn(SEQ, HIDDEN, generator=gen)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    return ids, mask, anchors, features, final, embed, head


def _close(ours, theirs, what):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float64),
                               torch.as_tensor(theirs, dtype=torch.float64), rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("kind,with_markov,chunk", [("vanilla", True, 5), ("gated", True, 1024), ("vanilla", False, 3),
                                                    ("gated", False, 7)])
def test_loss_terms_metrics_and_gradients_equal_specforges(kind, with_markov, chunk):
    pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                        reason="specforge==0.2.0 --no-deps (make test installs it)")
    from dspark_reference import specforge_drafter, specforge_online

    ids, mask, anchors, features, final, embed, head = _data(seed=len(kind) + chunk)
    drafter = make_dspark_drafter(markov_head_type=kind, with_markov=with_markov, block_size=BLOCK, std=0.2)
    theirs = specforge_drafter(drafter)

    objective = DSparkObjective(drafter, embed, head, ObjectiveSettings(attention="dense"),
                                DSparkLoss(chunk_rows=chunk))
    assert objective.gamma == 4.0 and objective.feature_width == 3 * HIDDEN
    batch = PackedBatch.from_documents([(ids.tolist(), mask.tolist())])
    blocks = objective.build(batch, anchors)
    loss_sum, metrics = objective(torch.cat([features, final], dim=-1), blocks)
    assert metrics.shape == (objective.metrics_size,)
    weight = metrics[WEIGHT_SUM]
    (loss_sum / weight.float()).backward()

    online = specforge_online(theirs, embed, head, block_size=BLOCK, gamma=4.0, anchors=anchors.tolist())
    loss, accuracy, info = online(ids[None], features[None], mask[None].float(), final[None])
    loss.backward()
    ratios = info["ratio_metrics"]

    _close(loss_sum / weight, loss, "total loss")
    _close(metrics[LOSS_SUM], loss.detach() * weight, "loss sum")
    tail = metrics[metrics_size(BLOCK):]
    _close(weight, ratios["ce_loss"][1], "weight sum")
    _close(tail[CE_SUM], ratios["ce_loss"][0], "cross-entropy")
    _close(tail[L1_SUM], ratios["l1_loss"][0], "L1")
    _close(tail[BCE_SUM], ratios["confidence_loss"][0], "confidence BCE")
    _close(tail[CONFIDENCE_ERROR_SUM], ratios["confidence_abs_error"][0], "confidence error")
    summary = summarize_dspark(metrics, BLOCK)
    num, den = ratios["tau_probabilistic"]
    _close(summary["tau_expected"], num / den, "expected acceptance")
    _close(summary["accuracy"], accuracy, "accuracy")
    correct, count = ratios["accuracy_position"]
    for slot in range(BLOCK):
        if count[slot] > 0:
            _close(summary["accuracy_by_position"][slot], correct[slot] / count[slot], f"accuracy of slot {slot}")

    grads = dict(theirs.named_parameters())
    for name, param in drafter.named_parameters():
        other = grads[name].grad
        assert param.grad is not None and other is not None, name
        torch.testing.assert_close(param.grad, other, rtol=1e-5, atol=1e-7, msg=name)


def test_pass_split_and_normalisation_match_one_pass():
    """Two passes' unnormalised sums, divided by their summed weight, give one pass's loss and gradients: the
    caller's global normalisation (``objective.loss``) holds for DSpark."""
    ids, mask, anchors, features, final, embed, head = _data(seed=3)
    batch = PackedBatch.from_documents([(ids.tolist(), mask.tolist())])
    inputs = torch.cat([features, final], dim=-1)
    grads = []
    for split in ([anchors], [anchors[:3], anchors[3:]]):
        drafter = make_dspark_drafter(block_size=BLOCK, std=0.2)
        objective = DSparkObjective(drafter, embed, head, ObjectiveSettings(attention="dense"))
        total, weight = 0.0, 0.0
        for part in split:
            loss_sum, metrics = objective(inputs, objective.build(batch, part))
            loss_sum.backward()
            total, weight = total + float(loss_sum.detach()), weight + float(metrics[WEIGHT_SUM])
        grads.append((total / weight, [p.grad / weight for p in drafter.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for one, two in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6 * float(one.abs().max()))


def test_refuses_dflash_only_settings():
    drafter = make_dspark_drafter()
    embed = head = torch.zeros(64, 32)
    with pytest.raises(ValueError, match="distill"):
        DSparkObjective(drafter, embed, head, ObjectiveSettings(distill=0.5))
    with pytest.raises(ValueError, match="'dflash' or 'dpace'"):
        DSparkObjective(drafter, embed, head, ObjectiveSettings(loss="other"))
    with pytest.raises(ValueError, match="l1_weight"):
        DSparkLoss(l1_weight=-1.0)
