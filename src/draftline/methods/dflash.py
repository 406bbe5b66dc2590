"""DFlash: the block-diffusion drafter as the DFlash paper trains it (docs/OBJECTIVE.md)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

from draftline.model.drafter import DFlashDrafter
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.sizing.shapes import MethodShape


class DFlash:
    """B inputs ``[anchor, MASK x (B-1)]`` draft B - 1 tokens; the loss is the weighted cross-entropy."""

    name = "dflash"
    first_slot = 1
    decodes_other_blocks = True
    """Decoding may draft from another block size than trained (``draftline eval --block-size``)."""

    def build_config(self, drafter_config: Qwen3Config) -> Qwen3Config:
        return drafter_config

    def default_layer_types(self, num_layers: int) -> list[str] | None:
        """None: ``model.config.build_drafter_config``'s rule (sliding x (n-1) + full for a hybrid target)."""
        return None

    def build_drafter(self, config: Qwen3Config) -> DFlashDrafter:
        return DFlashDrafter(config)

    def objective(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                  settings: ObjectiveSettings | None = None) -> DFlashObjective:
        return DFlashObjective(drafter, embed_weight, head_weight, settings)

    def needs_final_hidden(self, settings: ObjectiveSettings) -> bool:
        """Whether the target sends its final-normed hidden state with the features (soft labels only)."""
        return settings.distill > 0

    def drafts_per_block(self, block_size: int) -> int:
        return block_size - 1

    def shape(self, config: Qwen3Config, *, final_hidden: bool = False) -> MethodShape:
        """Nothing beyond the DFlash drafter (the final hidden state with soft labels: ``final_hidden``)."""
        return MethodShape(final_hidden=final_hidden)

    def proposer(self, drafter: DFlashDrafter, target: PreTrainedModel):
        from draftline.evaluate.speculative import DFlashProposer

        return DFlashProposer(drafter, target)

    def serving_commands(self, config: Qwen3Config, *, drafter: str = "$DRAFTER", target: str = "$TARGET") -> dict:
        from draftline.checkpoint.model_card import serving_commands

        return serving_commands(config, drafter=drafter, target=target)

    def describe(self, config: Qwen3Config) -> str:
        return "DFlash"
