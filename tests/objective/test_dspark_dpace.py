"""DSpark's three terms weighted by D-PACE (``ObjectiveSettings(loss='dpace')``) against a dense reference: full
logits, autograd, and D-PACE's weights computed here, slot by slot, from the reference's own cross-entropies."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from draftline.data.batch import PackedBatch
from draftline.objective.dspark import DSparkLoss, DSparkObjective, summarize_dspark
from draftline.objective.dspark_head_loss import dspark_row_ce
from draftline.objective.loss import ObjectiveSettings
from draftline.objective.metrics import LOSS_SUM, WEIGHT_SUM
from helpers import make_dspark_drafter

SEQ, BLOCK, HIDDEN, VOCAB = 22, 4, 32, 64
ALPHA = 0.5


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (SEQ,), generator=gen)
    mask = torch.ones(SEQ, dtype=torch.bool)
    mask[:3] = False  # the prompt
    mask[11] = False  # a turn boundary: the blocks of anchors 8 and 9 stop before it (unlabelled tail slots)
    anchors = torch.tensor([3, 5, 8, 9, 12, 16, 19, 20])  # 19 and 20: cut by the document's end
    features = torch.randn(SEQ, 2 * HIDDEN, generator=gen, dtype=torch.float64)
    final = torch.randn(SEQ, HIDDEN, generator=gen, dtype=torch.float64)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5
    return ids, mask, anchors, torch.cat([features, final], dim=-1), embed, head


def _dpace_by_slot(ce: torch.Tensor, label_rows: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weights, one block at a time: walk its labelled slots in order, P_k the running product of
    (1 - alpha) exp(-CE) + alpha, w_k the sum of P_m over the block's labelled slots m >= k."""
    weights = torch.empty_like(ce)
    blocks: dict[int, list[tuple[int, int]]] = {}
    for i, row in enumerate(label_rows.tolist()):
        blocks.setdefault(row // BLOCK, []).append((row % BLOCK, i))
    for slots in blocks.values():
        slots.sort()
        prefix, running = [], 1.0
        for _, i in slots:
            running = running * ((1 - alpha) * math.exp(-float(ce[i])) + alpha)
            prefix.append(running)
        for j, (_, i) in enumerate(slots):
            weights[i] = sum(prefix[j:])
    return weights


def _reference(drafter, objective, inputs, blocks, ce_weight, l1_weight, bce_weight):
    """(loss sum, number of labels, weights): full logits of the Markov-corrected and the target's heads."""
    features, final = inputs[:, :-HIDDEN], inputs[:, -HIDDEN:]
    rows = objective.hidden(features, blocks)[blocks.label_rows]
    bias, embedded = drafter.markov_head(blocks.prev_ids, rows, with_embedding=True)  # [M, V] materialised
    z = rows @ objective.head_weight.t() + bias
    p = torch.softmax(final[blocks.teacher_rows] @ objective.head_weight.t(), dim=-1)
    ce = F.cross_entropy(z, blocks.labels, reduction="none")
    l1 = (torch.softmax(z, dim=-1) - p).abs().sum(-1)
    accept = (1 - l1.detach() / 2).clamp(0, 1)
    confidence = drafter.confidence_head(rows, embedded)  # fp32 logits (model.dspark), so the BCE is fp32
    bce = F.binary_cross_entropy_with_logits(confidence, accept.to(confidence.dtype), reduction="none")
    weights = _dpace_by_slot(ce.detach(), blocks.label_rows, ALPHA)
    loss = (weights * (ce_weight * ce + l1_weight * l1 + bce_weight * bce)).sum()
    return loss, len(blocks.labels), weights


@pytest.mark.parametrize("chunk", [1, 3, 5, 1000])
@pytest.mark.parametrize("terms", [(0.1, 0.9, 1.0), (1.0, 0.0, 0.5)])
def test_loss_and_gradients_equal_a_dense_reference(chunk, terms):
    """Chunks of 3 and 5 rows split blocks of 4 slots (each block's weights need rows of two chunks); the blocks of
    anchors 8, 9, 19 and 20 have unlabelled tail slots."""
    ids, mask, anchors, inputs, embed, head = _data(seed=chunk)
    drafter = make_dspark_drafter(block_size=BLOCK, std=0.2).double()
    reference_drafter = copy.deepcopy(drafter)
    ce_weight, l1_weight, bce_weight = terms
    objective = DSparkObjective(drafter, embed, head, ObjectiveSettings(attention="dense", loss="dpace"),
                                DSparkLoss(ce_weight=ce_weight, l1_weight=l1_weight, confidence_weight=bce_weight,
                                           chunk_rows=chunk))
    assert objective.gamma == math.inf
    blocks = objective.build(PackedBatch.from_documents([(ids.tolist(), mask.tolist())]), anchors)
    assert (blocks.label_weights == 1).all()
    labelled_per_block = torch.bincount(blocks.label_rows // BLOCK, minlength=len(anchors))
    assert labelled_per_block.min() < BLOCK  # some blocks stop early
    loss_sum, metrics = objective(inputs, blocks)
    (loss_sum / metrics[WEIGHT_SUM]).backward()

    reference_objective = DSparkObjective(reference_drafter, embed, head, ObjectiveSettings(attention="dense"))
    expected, count, weights = _reference(reference_drafter, reference_objective, inputs, blocks, *terms)
    (expected / count).backward()

    assert float(metrics[WEIGHT_SUM]) == count  # the normaliser: the labels, whatever their D-PACE weights
    torch.testing.assert_close(loss_sum, expected, rtol=1e-10, atol=0)
    torch.testing.assert_close(metrics[LOSS_SUM], expected.detach(), rtol=1e-10, atol=0)
    assert float(weights.max() / weights.min()) > 5  # far from the uniform weights of the blocks
    references = dict(reference_drafter.named_parameters())
    for name, param in drafter.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, references[name].grad, rtol=1e-9, atol=1e-12, msg=name)
    summary = summarize_dspark(metrics, BLOCK)
    assert summary["loss"] == pytest.approx(float(expected.detach()) / count, rel=1e-10)


def test_the_position_weights_stay_without_dpace():
    """The default loss is DSpark's exp(-k / gamma) position weights: D-PACE's changes the loss."""
    ids, mask, anchors, inputs, embed, head = _data(seed=0)
    batch = PackedBatch.from_documents([(ids.tolist(), mask.tolist())])
    sums = {}
    for loss in ("dflash", "dpace"):
        objective = DSparkObjective(make_dspark_drafter(block_size=BLOCK, std=0.2).double(), embed, head,
                                    ObjectiveSettings(attention="dense", loss=loss))
        blocks = objective.build(batch, anchors)
        sums[loss] = objective(inputs, blocks)[0]
        if loss == "dflash":
            assert objective.gamma == 4.0
            torch.testing.assert_close(blocks.label_weights, torch.exp(-(blocks.label_rows % BLOCK) / 4.0))
    assert not torch.isclose(sums["dflash"], sums["dpace"])


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, 3.0)])
def test_the_row_cross_entropies_equal_the_dense_ones(multiplier, softcap):
    gen = torch.Generator().manual_seed(1)
    rows, rank = 11, 5
    hidden = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(rows, rank, generator=gen, dtype=torch.float64)
    w2 = torch.randn(VOCAB, rank, generator=gen, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (rows,), generator=gen)
    logits = hidden.detach() @ head.t() * multiplier
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    expected = F.cross_entropy(logits + latent @ w2.t(), labels, reduction="none")
    for chunk in (1, 4, 100):
        got = dspark_row_ce(hidden, latent, w2, head, labels, chunk_rows=chunk, multiplier=multiplier,
                            softcap=softcap)
        assert not got.requires_grad
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="chunk_rows"):
        dspark_row_ce(hidden, latent, w2, head, labels, chunk_rows=0)


def _loss_and_grads(device, head_dtype):
    """The D-PACE-weighted DSpark loss of seed 2's sample and its gradients (fp32 drafter, the head in
    ``head_dtype``), in chunks of 3 rows."""
    ids, mask, anchors, inputs, embed, head = _data(seed=2)
    batch = PackedBatch.from_documents([(ids.tolist(), mask.tolist())])
    drafter = make_dspark_drafter(block_size=BLOCK, std=0.2).to(device)
    objective = DSparkObjective(drafter, embed.float().to(device), head.to(device, head_dtype),
                                ObjectiveSettings(attention="dense", loss="dpace"), DSparkLoss(chunk_rows=3))
    blocks = objective.build(batch, anchors).to(device)
    loss_sum, _ = objective(inputs.float().to(device), blocks)
    loss_sum.backward()
    return loss_sum.detach().cpu().double(), {n: p.grad.cpu().double() for n, p in drafter.named_parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_weighted_loss_on_cuda_equals_the_cpu_s():
    """On CUDA the row cross-entropies come from the compiled stage 1 and the loss from the compiled chunks: the
    same loss and gradients as the eager CPU path (fp32 drafter and head)."""
    cuda, cpu = _loss_and_grads("cuda", torch.float32), _loss_and_grads("cpu", torch.float32)
    torch.testing.assert_close(cuda[0], cpu[0], rtol=1e-4, atol=1e-5)
    for name, grad in cpu[1].items():
        torch.testing.assert_close(cuda[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


BF16_ROUNDOFF = 2.0**-8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_bf16_head_gives_the_fp64_heads_loss_and_gradients_within_bf16s_rounding(device):
    """With the head in bf16 (on CUDA: the row kernel), the loss is the one with the head in fp64 within bf16's unit
    roundoff u = 2^-8, relative, and each gradient within 8u in relative norm. Entry by entry they differ by more:
    where q and p are close, the logits' rounding flips the L1 term's sign. On CPU the worst gradient is 1.2e-2
    (about 3u) from the fp64 head's. One of the 22 rows lost (its weight 0) moves the loss by 3.0e-2 and the worst
    gradient by 0.17 on CPU: both bounds fail by 5x or more."""
    exact = _loss_and_grads("cpu", torch.float64)
    loss, grads = _loss_and_grads(device, torch.bfloat16)
    assert abs(loss - exact[0]) <= BF16_ROUNDOFF * abs(exact[0])
    errors = {name: float((grads[name] - grad).norm() / grad.norm()) for name, grad in exact[1].items()}
    assert max(errors.values()) <= 8 * BF16_ROUNDOFF, sorted(errors.items(), key=lambda item: -item[1])[:5]
