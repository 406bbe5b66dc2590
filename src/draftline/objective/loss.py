"""The DFlash training objective: the one place a packed batch and its features become a loss.

``DFlashObjective.passes`` samples the anchors of a batch, splits them into passes and builds each
pass's blocks and labels on the host; ``DFlashObjective.forward`` runs one pass (all its blocks in
one attention pass). The objective, exactly as implemented: docs/OBJECTIVE.md.

``DFlashObjective.forward`` returns the UNNORMALISED weighted loss sum of a pass. The caller
divides the accumulated gradients by the total label weight of the whole optimizer step (summed
over micro-batches and ranks), so the result does not depend on how a step is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.nn import functional as F

from draftline.data.batch import PackedBatch
from draftline.model.attention import make_attention
from draftline.model.config import default_loss_gamma, mask_token_id
from draftline.model.drafter import DFlashDrafter
from draftline.objective.anchors import sample_anchors
from draftline.objective.blocks import BlockBatch, Pass, build_blocks, plan_passes
from draftline.objective.dpace import dpace_weights
from draftline.objective.head_loss import chunked_head_loss
from draftline.objective.metrics import metrics_size, pass_metrics, summarize


DENSE_MAX_ENTRIES = 2**16
"""Largest attention mask (block rows x keys) of one pass on the dense path."""


@dataclass
class ObjectiveSettings:
    max_anchors: int = 512
    """Anchors sampled per document (not per packed row)."""
    gamma: float | None = None
    """Decay of the per-slot loss weights; None = the paper's value for the block size."""
    head_chunk_rows: int = 4096
    """Rows of logits materialised at once by the LM head."""
    attention: str = "auto"
    """'auto' (flex on GPU, dense on CPU), 'flex', 'flash' (flex on FlashAttention-4) or 'dense'."""
    seed: int = 0
    distill: float = 0.0
    """Weight of the target's own next-token distribution in each label (soft labels); above 0 the
    features carry the target's final-normed hidden state as their last ``hidden_size`` columns."""
    fused_head: bool = True
    """On CUDA, the head loss's chunks in a compiled body (``head_loss.chunked_head_loss``)."""
    loss: str = "dflash"
    """'dflash' (each label weighted exp(-(k-1)/gamma)) or 'dpace' (weighted by its share of the block's
    expected acceptance, ``objective.dpace``)."""
    dpace_alpha: float = 0.5
    """D-PACE's smoothing: a slot's acceptance counts as (1 - alpha) q + alpha."""


class DFlashObjective:
    """Blocks from a packed batch and the weighted cross-entropy of the drafter on them.

    ``embed_weight`` and ``head_weight`` are the target's, frozen (no gradients).
    """

    first_slot = 1
    """The block's first drafted slot: slot 0 holds the anchor and has no label (``metrics.pass_metrics``)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        settings: ObjectiveSettings | None = None,
    ):
        self.drafter = drafter
        self.settings = settings or ObjectiveSettings()
        config = drafter.config
        self.block_size = drafter.block_size
        self.mask_token_id = mask_token_id(config)
        if self.settings.loss not in ("dflash", "dpace"):
            raise ValueError(f"loss must be 'dflash' or 'dpace', got {self.settings.loss!r}")
        # D-PACE weighs each label itself: its blocks carry weight 1 per label (gamma = inf), which also
        # makes the step's normaliser the count of its labels, the same on every drafter and pass.
        self.dpace = self.settings.loss == "dpace"
        if self.dpace and self.settings.distill > 0:
            raise ValueError("the D-PACE loss weighs hard labels; it does not combine with distill > 0")
        self.gamma = math.inf if self.dpace else self.settings.gamma or default_loss_gamma(self.block_size)
        dflash = getattr(config, "dflash_config", {}) or {}
        self.embed_scale = float(dflash.get("input_embedding_scale", 1.0))
        self.logit_multiplier = float(dflash.get("output_multiplier", 1.0))
        self.softcap = dflash.get("final_logit_softcapping")
        self.embed_weight = embed_weight.detach()
        self.head_weight = head_weight.detach()

    @property
    def feature_width(self) -> int:
        """Columns of the features a pass takes: the K fused layers, plus (soft labels) the target's final
        hidden state."""
        hidden = self.drafter.config.hidden_size
        return (len(self.drafter.target_layer_ids) + int(self.settings.distill > 0)) * hidden

    @property
    def metrics_size(self) -> int:
        """Entries of the metrics vector a pass returns (``objective.metrics``)."""
        return metrics_size(self.block_size)

    def summarize(self, vector: torch.Tensor) -> dict:
        """The host-side summary of a (summed) metrics vector; syncs with the device."""
        return summarize(vector, self.block_size, self.first_slot)

    def build(self, batch: PackedBatch, anchors: torch.Tensor) -> BlockBatch:
        """The blocks of ``anchors`` (flat token indices into ``batch``, sorted), built on the host."""
        return build_blocks(batch, anchors, block_size=self.block_size, mask_token_id=self.mask_token_id,
                            gamma=self.gamma)

    def blocks(self, batch: PackedBatch) -> BlockBatch:
        """Anchors, block inputs and labels of ``batch``, built on the host."""
        return self.build(batch, sample_anchors(batch, self.settings.max_anchors, self.settings.seed))

    def dense_attention(self, device: torch.device) -> bool:
        """Whether passes on ``device`` use the dense attention path (every query-key pair)."""
        attention = self.settings.attention
        return attention == "dense" or (attention == "auto" and device.type != "cuda")

    def passes(self, batch: PackedBatch, max_anchors_per_pass: int, *, dense: bool) -> Iterator[tuple[Pass, BlockBatch]]:
        """The passes of ``batch`` and their blocks, built on the host.

        The batch's anchors go in order into passes of at most ``max_anchors_per_pass``; with
        ``dense`` a pass also ends before its mask would exceed ``DENSE_MAX_ENTRIES``. Each pass
        holds whole documents: its features are ``features[pass.token_lo : pass.token_hi]``.
        """
        anchors = sample_anchors(batch, self.settings.max_anchors, self.settings.seed)
        for part in plan_passes(batch, anchors, max_anchors_per_pass, self.block_size,
                                max_dense_entries=DENSE_MAX_ENTRIES if dense else None):
            yield part, self.build(part.batch, part.anchors)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed_weight)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def hidden(self, features: torch.Tensor, blocks: BlockBatch) -> torch.Tensor:
        """Final drafter hidden states of every block row, [N * B, H]."""
        attend = make_attention(blocks.layout, self.drafter.config, self.settings.attention)
        return self.drafter(
            self.embed(blocks.block_input_ids),
            features,
            blocks.block_positions,
            blocks.context_positions,
            attend,
        )

    def forward(self, features: torch.Tensor, blocks: BlockBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss sum, metrics vector) of one pass; both stay on the device."""
        teacher = None
        if self.settings.distill > 0:
            width = self.head_weight.shape[1]
            features, teacher = features[:, :-width], features[:, -width:][blocks.teacher_rows]
        if blocks.num_anchors == 0:
            zero = features.sum() * 0.0  # keeps the graph connected for a batch without anchors
            return zero, pass_metrics(zero, torch.zeros(0, dtype=torch.bool, device=features.device),
                                      blocks.label_rows, blocks.label_weights, 0, self.block_size)
        hidden = self.hidden(features, blocks)
        weigh = None
        if self.dpace:
            alpha = self.settings.dpace_alpha
            weigh = lambda ce: dpace_weights(ce, blocks.label_rows, blocks.num_anchors, self.block_size, alpha)  # noqa: E731
        loss_sum, correct = chunked_head_loss(
            hidden[blocks.label_rows],
            self.head_weight,
            blocks.labels,
            blocks.label_weights,
            chunk_rows=self.settings.head_chunk_rows,
            multiplier=self.logit_multiplier,
            softcap=self.softcap,
            teacher=teacher,
            distill=self.settings.distill,
            fused=self.settings.fused_head,
            weigh=weigh,
        )
        metrics = pass_metrics(
            loss_sum.detach(), correct, blocks.label_rows, blocks.label_weights, blocks.num_anchors, self.block_size
        )
        return loss_sum, metrics

    __call__ = forward
