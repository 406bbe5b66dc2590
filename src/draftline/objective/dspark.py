"""The DSpark training objective: DFlash's passes and attention, DSpark's slots and its three-term loss.

Per labelled slot (``objective.dspark_blocks``: slot k of anchor p predicts ``x_{p+k+1}``, weight
``w = exp(-k / gamma)``), with ``q`` the drafter's Markov-corrected distribution and ``p`` the target's (its
final hidden state at ``p + k`` through the frozen LM head):

    loss = ce_weight CE(q, x_{p+k+1}) + l1_weight sum|q - p| + confidence_weight BCE(c, stop_grad(a))
    a = clamp(1 - sum|q - p| / 2, 0, 1)              c = the confidence head's logit

(DeepSpec ``loss.py``; SpecForge's ``OnlineDSparkModel``: 0.1, 0.9, 1.0). A pass returns the UNNORMALISED sum
``sum w * loss`` and its metrics vector; the caller divides by the step's total weight ``sum w`` over every pass
and drafter, exactly as for DFlash (``objective.loss``): the references' global normaliser, the same on every
drafter. The full-vocabulary terms run in chunks (``objective.dspark_head_loss``; memory per chunk there).

With the D-PACE loss (``ObjectiveSettings.loss = 'dpace'``) each labelled row's weight is instead its D-PACE weight
(``objective.dpace``) from the detached cross-entropies of the Markov-corrected logits of its block, slot 0 first,
and it weighs all three terms. As in DFlash's D-PACE, the blocks' own weights are 1 per label (gamma = inf), so the
step's normaliser ``sum w`` over the blocks' weights is the step's count of labelled rows: the same on every
drafter and pass, whatever the D-PACE weights are. The cross-entropies come from a no-grad pass over the head
before the loss (``dspark_head_loss.dspark_row_ce``), since a block's rows may fall in different chunks.

The features of a pass carry the target's final-normed hidden state as their last ``hidden_size`` columns
(``feature_width``): the target must send it (``TargetFeatures(final_hidden=True)``).

Metrics: the ``objective.metrics`` vector with every slot drafted (``first_slot`` 0), then DSpark's own entries
(``DSPARK_TAIL``): the weighted sums of each term (D-PACE's weights with that loss: the terms as trained), the
confidence head's absolute error, the expected acceptance
``1 + sum_k prod_{i<=k} a_i`` summed over blocks, and per slot the sums of the predicted confidence and of ``a``
(their ratio to the slot's label count is the calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from draftline.data.batch import PackedBatch
from draftline.model.dspark import DSparkDrafter
from draftline.objective.blocks import BlockBatch
from draftline.objective.dspark_blocks import build_dspark_blocks, default_dspark_gamma
from draftline.objective.dpace import dpace_weights
from draftline.objective.dspark_head_loss import CHUNK_ROWS, dspark_head_loss, dspark_row_ce
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.objective.metrics import metrics_size, pass_metrics, summarize

CE_SUM, L1_SUM, BCE_SUM, CONFIDENCE_ERROR_SUM, TAU_SUM = range(5)
DSPARK_TAIL = 5
"""Entries after the metrics head, before the two per-slot lists (confidence, acceptance)."""


@dataclass
class DSparkLoss:
    """The weights of DSpark's three terms (DeepSpec's and SpecForge's defaults) and its chunking."""

    ce_weight: float = 0.1
    """Cross-entropy of the Markov-corrected logits against the data's token."""
    l1_weight: float = 0.9
    """L1 distance between the drafter's and the target's distributions (twice their total variation)."""
    confidence_weight: float = 1.0
    """Binary cross-entropy of the confidence head against the slot's expected acceptance."""
    chunk_rows: int = CHUNK_ROWS
    """Labelled rows whose full-vocabulary logits exist at once: on CUDA ``FUSED_BYTES_PER_LOGIT`` (6) x rows x
    vocab bytes with a bf16 head at most (2.8 GiB at 2,048 rows and a 248K vocabulary;
    ``objective.dspark_head_loss``). At the 8B shape on an H100 (docs/benchmarks/2026-12-dspark-step.md, section
    14) the step took 156.7-158.2 ms at 2,048 rows against 160.3-161.0 at 1,024, 158.3 at 3,072 and 158.0 at
    4,096; its peak 20.14 GiB against 20.03, 20.51 and 20.89: 2,048 is the default. Fewer chunks mean fewer of the
    Markov weight's fp32 gradient sums and larger matmuls."""
    row_kernel: bool = True
    """On CUDA, with a bf16 or fp16 head's unscaled logits: each chunk's three passes over the logits in one Triton kernel
    that holds a row through them (``objective.dspark_row_kernel``); False: three compiled stages, each reading the
    logits from device memory."""

    def __post_init__(self):
        for name in ("ce_weight", "l1_weight", "confidence_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DSpark's {name} must be >= 0, got {getattr(self, name)}")
        if self.chunk_rows < 1:
            raise ValueError(f"DSpark's chunk_rows must be >= 1, got {self.chunk_rows}")


def dspark_metrics_size(block_size: int) -> int:
    return metrics_size(block_size) + DSPARK_TAIL + 2 * block_size


class DSparkObjective(DFlashObjective):
    """DSpark's blocks and loss on the DFlash objective's passes, attention and embedding.

    ``settings``: the shared objective settings (anchors, gamma (None: 4), attention, seed, ``loss``: 'dflash'
    for DSpark's position weights, 'dpace' for D-PACE's, with ``dpace_alpha``); soft labels are DFlash's and are
    refused. ``loss``: the three terms' weights.
    """

    first_slot = 0

    def __init__(self, drafter: DSparkDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 settings: ObjectiveSettings | None = None, loss: DSparkLoss | None = None):
        settings = settings or ObjectiveSettings()
        if settings.distill > 0:
            raise ValueError("DSpark's loss distils the target's distribution already (its L1 term); distill must be 0")
        if not isinstance(drafter, DSparkDrafter):
            raise ValueError("the DSpark objective trains a DSparkDrafter (model.dspark), got "
                             f"{type(drafter).__name__}")
        super().__init__(drafter, embed_weight, head_weight, settings)  # self.dpace: settings.loss == 'dpace'
        self.loss = loss or DSparkLoss()
        # D-PACE weighs each row itself: its blocks carry weight 1 per label, as DFlash's D-PACE blocks do.
        self.gamma = math.inf if self.dpace else settings.gamma or default_dspark_gamma(self.block_size)

    @property
    def feature_width(self) -> int:
        """The K fused layers and the target's final-normed hidden state (the target's distribution)."""
        return (len(self.drafter.target_layer_ids) + 1) * self.drafter.config.hidden_size

    @property
    def metrics_size(self) -> int:
        return dspark_metrics_size(self.block_size)

    def summarize(self, vector: torch.Tensor) -> dict:
        return summarize_dspark(vector, self.block_size)

    def build(self, batch: PackedBatch, anchors: torch.Tensor) -> BlockBatch:
        return build_dspark_blocks(batch, anchors, block_size=self.block_size, mask_token_id=self.mask_token_id,
                                   gamma=self.gamma, chunk_rows=self.loss.chunk_rows)

    def forward(self, features: torch.Tensor, blocks: BlockBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss sum, metrics vector) of one pass; both stay on the device."""
        width = self.head_weight.shape[1]
        features, final = features[:, :-width], features[:, -width:]
        if blocks.num_anchors == 0:
            zero = features.sum() * 0.0  # keeps the graph connected for a batch without anchors
            metrics = torch.zeros(self.metrics_size, dtype=torch.float64, device=features.device)
            return zero, metrics
        rows = self.hidden(features, blocks)[blocks.label_rows]
        settings = self.loss
        distinct = blocks.teacher if blocks.teacher and blocks.teacher.chunk_rows == settings.chunk_rows else None
        teacher = final[blocks.teacher_rows if distinct is None else distinct.rows]

        def head_loss(latent, w2):
            weights = blocks.label_weights
            if self.dpace:
                weights = weights * self.dpace_row_weights(rows, latent, w2, blocks)
            terms = dspark_head_loss(rows, latent, w2, self.head_weight, blocks.labels, teacher, weights,
                                     ce_weight=settings.ce_weight, l1_weight=settings.l1_weight,
                                     chunk_rows=settings.chunk_rows, multiplier=self.logit_multiplier,
                                     softcap=self.softcap, teacher_index=None if distinct is None else distinct.index,
                                     teacher_offsets=None if distinct is None else distinct.offsets,
                                     row_kernel=settings.row_kernel)
            return terms, weights

        # Each head through its own module call, once per pass: sharded (FSDP2), a head's weights are gathered for
        # its forward (and again for its backward) and exist only then.
        ((loss, ce_sum, l1_sum, accept, correct), weights), embedded = self.drafter.markov_head(
            blocks.prev_ids, rows, apply=head_loss, with_embedding=True)
        weights = weights.to(loss.dtype)
        head = self.drafter.confidence_head
        confidence = None if head is None else head(rows, embedded if head.with_markov else None)
        bce_sum = error_sum = torch.zeros((), dtype=loss.dtype, device=loss.device)
        if confidence is not None:
            target = accept.to(confidence.dtype)
            bce = F.binary_cross_entropy_with_logits(confidence, target, reduction="none")
            bce_sum = (bce * weights).sum()
            error_sum = ((confidence.detach().sigmoid() - target).abs() * weights).sum()
            if settings.confidence_weight > 0:
                loss = loss + settings.confidence_weight * bce_sum
        metrics = torch.cat([
            pass_metrics(loss.detach(), correct, blocks.label_rows, blocks.label_weights, blocks.num_anchors,
                         self.block_size, first_slot=0),
            self._tail(blocks, ce_sum, l1_sum, bce_sum.detach(), error_sum, accept,
                       None if confidence is None else confidence.detach().sigmoid()),
        ])
        return loss, metrics

    __call__ = forward

    def dpace_row_weights(self, rows: torch.Tensor, latent: torch.Tensor, w2: torch.Tensor,
                          blocks: BlockBatch) -> torch.Tensor:
        """Each labelled row's D-PACE weight [M], detached, from its Markov-corrected cross-entropy (DSpark's slots:
        slot 0, the anchor's, first in each block's products). A block's rows may fall in different chunks of the
        loss, so their cross-entropies come from a no-grad pass of their own before it (``dspark_row_ce``)."""
        ce = dspark_row_ce(rows, latent, w2, self.head_weight, blocks.labels, chunk_rows=self.loss.chunk_rows,
                           multiplier=self.logit_multiplier, softcap=self.softcap)
        return dpace_weights(ce, blocks.label_rows, blocks.num_anchors, self.block_size, self.settings.dpace_alpha)

    def _tail(self, blocks, ce_sum, l1_sum, bce_sum, error_sum, accept, predicted) -> torch.Tensor:
        size, rows = self.block_size, blocks.num_anchors * self.block_size
        device = accept.device
        per_row = torch.zeros(2, rows, dtype=torch.float64, device=device)
        per_row[1, blocks.label_rows] = accept.double()
        if predicted is not None:
            per_row[0, blocks.label_rows] = predicted.double()
        per_slot = per_row.view(2, blocks.num_anchors, size)
        # Expected acceptance of a block from the drafter's own distributions: 1 + sum_k prod_{i<=k} a_i (an
        # unlabelled slot, after the block's last label, adds nothing).
        tau = 1.0 + torch.cumprod(per_slot[1], dim=1).sum(dim=1)
        head = torch.stack([ce_sum.double(), l1_sum.double(), bce_sum.double(), error_sum.double(), tau.sum()])
        return torch.cat([head, per_slot.sum(dim=1).reshape(-1)])


def summarize_dspark(vector: torch.Tensor, block_size: int) -> dict:
    """``metrics.summarize`` (every slot drafted) plus DSpark's terms and the confidence head's calibration."""
    summary = summarize(vector, block_size, first_slot=0)
    v = vector.detach().double().cpu()
    base = metrics_size(block_size)
    tail = v[base : base + DSPARK_TAIL]
    predicted = v[base + DSPARK_TAIL : base + DSPARK_TAIL + block_size]
    realised = v[base + DSPARK_TAIL + block_size : base + DSPARK_TAIL + 2 * block_size]
    count = v[base - block_size : base]  # labels per slot: the last entries of objective.metrics' head
    weight, blocks = summary["weight_sum"], summary["num_blocks"]
    ratio = lambda num, den: float(num / den) if den > 0 else float("nan")  # noqa: E731
    summary.update(
        ce=ratio(tail[CE_SUM], weight),
        l1=ratio(tail[L1_SUM], weight),
        confidence_bce=ratio(tail[BCE_SUM], weight),
        confidence_abs_error=ratio(tail[CONFIDENCE_ERROR_SUM], weight),
        tau_expected=ratio(tail[TAU_SUM], blocks),
        confidence_by_position=[ratio(p, n) for p, n in zip(predicted, count)],
        expected_acceptance_by_position=[ratio(a, n) for a, n in zip(realised, count)],
    )
    return summary
