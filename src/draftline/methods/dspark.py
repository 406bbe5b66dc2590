"""DSpark (arXiv 2607.05147): the DFlash backbone, a Markov head and a confidence head (``model.dspark``)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

from draftline.errors import DraftlineError
from draftline.model.dspark import DEFAULT_MARKOV_RANK, DSparkDrafter, build_dspark_config
from draftline.objective.dspark import DSparkLoss, DSparkObjective
from draftline.objective.dspark_head_loss import FUSED_BYTES_PER_LOGIT
from draftline.objective.loss import ObjectiveSettings
from draftline.sizing.shapes import MethodShape


class DSpark:
    """B inputs draft B tokens (the anchor is the first prediction slot), the Markov head corrects each slot
    from the token before it; the loss is 0.1 CE + 0.9 L1 against the target's distribution + 1.0 BCE of the
    confidence head (``objective.dspark``)."""

    name = "dspark"
    first_slot = 0
    decodes_other_blocks = False
    """Decoding drafts from the training block only: each slot's draft (and the Markov chain) reads the whole block."""

    def __init__(self, *, markov_rank: int = DEFAULT_MARKOV_RANK, markov_head_type: str = "vanilla",
                 confidence_head: bool = True, confidence_head_with_markov: bool = True,
                 loss: DSparkLoss | None = None):
        self.heads = dict(markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head=confidence_head,
                          confidence_head_with_markov=confidence_head_with_markov and confidence_head)
        self.loss = loss or DSparkLoss()

    @classmethod
    def of_train_config(cls, config) -> "DSpark":
        """The DSpark a run's ``TrainConfig`` asks for: its [model] heads (None: the defaults) and loss weights."""
        m = config.model
        head_on = m.confidence_head is not False
        ce, l1, bce = config.optim.dspark_loss_weights
        return cls(markov_rank=m.markov_rank or DEFAULT_MARKOV_RANK, markov_head_type=m.markov_head_type or "vanilla",
                   confidence_head=head_on,
                   confidence_head_with_markov=head_on and m.confidence_head_with_markov is not False,
                   loss=DSparkLoss(ce_weight=ce, l1_weight=l1, confidence_weight=bce))

    @classmethod
    def of_config(cls, config, loss: DSparkLoss | None = None) -> "DSpark":
        """The DSpark whose heads a DSpark drafter config (object or config.json dict) has."""
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
        return cls(markov_rank=get("markov_rank"), markov_head_type=get("markov_head_type"),
                   confidence_head=get("enable_confidence_head"),
                   confidence_head_with_markov=get("confidence_head_with_markov"), loss=loss)

    def build_config(self, drafter_config: Qwen3Config) -> Qwen3Config:
        scaling = sorted(set(drafter_config.dflash_config) - {"mask_token_id", "target_layer_ids"})
        if scaling:
            raise DraftlineError(f"the target scales its logits ({', '.join(scaling)}): SGLang's and vLLM's DSpark "
                                 "drafting apply the LM head without that, so a DSpark drafter for this target would "
                                 "not be served as trained; train it with --method dflash")
        return build_dspark_config(drafter_config, **self.heads)

    def default_layer_types(self, num_layers: int) -> list[str] | None:
        """Full attention in every layer, also for a hybrid target: DeepSpec and SpecForge train DSpark with full
        attention only (SpecForge's Qwen3.6-27B DSpark config: 5 full layers); ``--layer-types`` still sets others."""
        return ["full_attention"] * num_layers

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

    def shape(self, config: Qwen3Config, *, final_hidden: bool = True) -> MethodShape:
        """The heads' trained weights and the matmuls a labelled row runs through them (the Markov embedding is a
        lookup: no FLOPs), the teacher's head on the target's final hidden state, DSpark's loss chunk
        (``objective.dspark_head_loss``) and its fp32 [V, r] buffer."""
        hidden, vocab, rank = int(config.hidden_size), int(config.vocab_size), int(config.markov_rank)
        gate = (hidden + rank) * rank if config.markov_head_type == "gated" else 0  # gate_proj, its bias aside
        confidence = 0
        if config.enable_confidence_head:
            confidence = hidden + (rank if config.confidence_head_with_markov else 0)  # proj, its bias aside
        biases = (rank if gate else 0) + (1 if confidence else 0)
        return MethodShape(
            drafts_anchor_slot=True,
            head_params=2 * vocab * rank + gate + confidence + biases,
            row_params=vocab * rank + gate + confidence,
            teacher_head=True,
            final_hidden=True,
            loss_chunk_rows=self.loss.chunk_rows,
            loss_bytes_per_logit=FUSED_BYTES_PER_LOGIT,  # sizing is for CUDA, where the chunks are compiled
            loss_fixed_bytes=4 * vocab * rank,
        )

    def proposer(self, drafter: DSparkDrafter, target: PreTrainedModel):
        from draftline.evaluate.dspark_proposer import DSparkProposer

        return DSparkProposer(drafter, target)

    def serving_commands(self, config: Qwen3Config, *, drafter: str = "$DRAFTER", target: str = "$TARGET") -> dict:
        from draftline.checkpoint.dspark_card import dspark_serving_commands

        return dspark_serving_commands(config, drafter=drafter, target=target)

    def describe(self, config: Qwen3Config) -> str:
        confidence = ("a confidence head on [h; Markov embedding]" if config.confidence_head_with_markov
                      else "a confidence head on h" if config.enable_confidence_head else "no confidence head")
        loss = self.loss
        return (f"DSpark: {config.markov_head_type} Markov head of rank {config.markov_rank}, {confidence}; loss "
                f"{loss.ce_weight:g} CE + {loss.l1_weight:g} L1 + {loss.confidence_weight:g} BCE")
