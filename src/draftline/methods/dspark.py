"""DSpark (arXiv 2607.05147): the DFlash backbone, a Markov head and a confidence head (``model.dspark``)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

from draftline.model.dspark import DEFAULT_MARKOV_RANK, DSparkDrafter, build_dspark_config
from draftline.objective.dspark import DSparkLoss, DSparkObjective
from draftline.objective.loss import ObjectiveSettings


class DSpark:
    """B inputs draft B tokens (the anchor is the first prediction slot), the Markov head corrects each slot
    from the token before it; the loss is 0.1 CE + 0.9 L1 against the target's distribution + 1.0 BCE of the
    confidence head (``objective.dspark``)."""

    name = "dspark"
    first_slot = 0

    def __init__(self, *, markov_rank: int = DEFAULT_MARKOV_RANK, markov_head_type: str = "vanilla",
                 confidence_head: bool = True, confidence_head_with_markov: bool = True,
                 loss: DSparkLoss | None = None):
        self.heads = dict(markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head=confidence_head,
                          confidence_head_with_markov=confidence_head_with_markov)
        self.loss = loss or DSparkLoss()

    def build_config(self, drafter_config: Qwen3Config) -> Qwen3Config:
        return build_dspark_config(drafter_config, **self.heads)

    def build_drafter(self, config: Qwen3Config) -> DSparkDrafter:
        return DSparkDrafter(config)

    def objective(self, drafter: DSparkDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                  settings: ObjectiveSettings | None = None) -> DSparkObjective:
        return DSparkObjective(drafter, embed_weight, head_weight, settings, self.loss)

    def needs_final_hidden(self, settings: ObjectiveSettings) -> bool:
        """Always: the target's final-normed hidden state gives its distribution for the L1 and BCE terms."""
        return True

    def drafts_per_block(self, block_size: int) -> int:
        return block_size

    def proposer(self, drafter: DSparkDrafter, target: PreTrainedModel):
        from draftline.evaluate.dspark_proposer import DSparkProposer

        return DSparkProposer(drafter, target)

    def serving_commands(self, config: Qwen3Config, *, drafter: str = "$DRAFTER", target: str = "$TARGET") -> dict:
        from draftline.checkpoint.dspark_card import dspark_serving_commands

        return dspark_serving_commands(config, drafter=drafter, target=target)
