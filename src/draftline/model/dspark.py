"""The DSpark drafter: the DFlash backbone plus a Markov head and a confidence head. Architecture only.

DSpark (arXiv 2607.05147; DeepSpec's training code) keeps the DFlash backbone (``model.drafter``) and adds
two small heads on its final hidden state ``h_k`` of block slot ``k``:

- the **Markov head** adds a bias that depends on the previous token ``x_{k-1}`` to slot ``k``'s logits,
  ``W2 W1[x_{k-1}]`` (``markov_w1``: an embedding [V, r]; ``markov_w2``: a linear r -> V without bias). The
  gated form scales the embedding first, ``W2 (sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}])``
  (``gate_proj``: a linear H + r -> r with bias). Training feeds the true previous tokens, so every slot is
  computed at once; decoding applies it slot by slot on the tokens just drafted.
- the **confidence head** predicts the chance that slot ``k``'s draft is accepted: one logit from
  ``proj([h_k; W1[x_{k-1}]])`` (``confidence_head_with_markov``) or ``proj(h_k)`` (a linear with bias).

The fields (``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``)
sit at the top level of the config, as DeepSpec, SGLang and vLLM read them; ``architectures`` is
``["Qwen3DSparkModel"]``. Every weight starts as the references start it (Hugging Face's ``_init_weights``
under DeepSpec's and SpecForge's ``post_init``): linears and the embedding Normal(0, initializer_range),
biases zero.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import Qwen3Config

from draftline.errors import DraftlineError
from draftline.model.drafter import DFlashDrafter

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
DEFAULT_MARKOV_RANK = 256
MARKOV_HEAD_TYPES = ("vanilla", "gated")
_HEAD_TYPES = " or ".join(MARKOV_HEAD_TYPES)
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def build_dspark_config(
    drafter_config: Qwen3Config,
    *,
    markov_rank: int = DEFAULT_MARKOV_RANK,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
) -> Qwen3Config:
    """The DSpark drafter config: a DFlash drafter config (``model.config.build_drafter_config``) plus the
    heads' fields. ``block_size`` keeps its meaning for the block's inputs: B inputs ``[anchor, MASK x (B-1)]``
    give B drafted tokens."""
    config = copy.deepcopy(drafter_config)
    config.architectures = [DSPARK_ARCHITECTURE]
    config.markov_rank = int(markov_rank)
    config.markov_head_type = str(markov_head_type)
    config.enable_confidence_head = bool(confidence_head)
    config.confidence_head_with_markov = bool(confidence_head_with_markov) and bool(confidence_head)
    validate_dspark_config(config)
    return config


def is_dspark_config(config: Any) -> bool:
    """Whether ``config`` (a config object or a config.json dict) describes a DSpark drafter."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    return DSPARK_ARCHITECTURE in (get("architectures", None) or []) or get("markov_rank", None) is not None


def validate_dspark_config(config: Qwen3Config) -> None:
    """Raise DraftlineError naming the field and the fix if ``config``'s DSpark heads cannot be built."""
    rank = getattr(config, "markov_rank", None)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise DraftlineError(f"markov_rank={rank!r}: DSpark's Markov head needs a positive rank (256 by default); "
                             "SGLang refuses a DSpark drafter without one")
    kind = getattr(config, "markov_head_type", None)
    if kind not in MARKOV_HEAD_TYPES:
        raise DraftlineError(f"markov_head_type={kind!r}: draftline builds {_HEAD_TYPES} Markov heads")
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(getattr(config, name, None), bool):
            raise DraftlineError(f"{name}={getattr(config, name, None)!r}: it must be true or false")
    if config.confidence_head_with_markov and not config.enable_confidence_head:
        raise DraftlineError("confidence_head_with_markov is true but enable_confidence_head is false: "
                             "turn the confidence head on, or set confidence_head_with_markov to false")


class MarkovHead(nn.Module):
    """The previous-token logit bias of one slot: ``markov_w2(latent)``, latent = W1[x] (vanilla) or
    sigmoid(gate_proj([h; W1[x]])) * W1[x] (gated)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in MARKOV_HEAD_TYPES:
            raise DraftlineError(f"markov_head_type={kind!r}: draftline builds {_HEAD_TYPES} Markov heads")
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}], [..., r]."""
        return self.markov_w1(prev_ids)

    def latent(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """What ``markov_w2`` turns into the bias, [..., r]; ``hidden`` [..., H] is read by the gated head only."""
        embedded = self.embed(prev_ids)
        return embedded if self.kind == "vanilla" else self._gated(embedded, hidden)

    def _gated(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)))
        return gate.to(embedded.dtype) * embedded

    def forward(self, prev_ids: torch.Tensor, hidden: torch.Tensor, apply=None, with_embedding: bool = False):
        """The bias added to the slots' logits, [..., V]. With ``apply``: ``apply(latent, markov_w2.weight)``
        instead, so that a training loss that forms the bias chunk by chunk runs inside this module's call (a
        head sharded from outside is gathered for it, as for any forward). ``with_embedding``: also return
        W1[x_{k-1}] (the confidence head's Markov input), from this one call: a sharded head's weights exist only
        inside its forward."""
        embedded = self.embed(prev_ids)
        latent = embedded if self.kind == "vanilla" else self._gated(embedded, hidden)
        out = self.markov_w2(latent) if apply is None else apply(latent, self.markov_w2.weight)
        return (out, embedded) if with_embedding else out


class ConfidenceHead(nn.Module):
    """One logit per slot: the predicted chance that its draft is accepted."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., H], embedded [..., r] (W1[x_{k-1}]; unused without the Markov input) -> logits [...] fp32."""
        if self.with_markov:
            hidden = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        # proj as a matrix-vector product: a fresh tensor, not a squeezed view of [..., 1] (a sharded head's
        # output must not be a view: FSDP2's backward hook hangs on it)
        return (torch.matmul(hidden, self.proj.weight[0]) + self.proj.bias[0]).float()


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone (its ``forward`` returns the block rows' final hidden states, unchanged) with the
    DSpark heads as ``markov_head`` and ``confidence_head`` (None when off). Parameter names are the export's."""

    method = "dspark"

    def __init__(self, config: Qwen3Config):
        validate_dspark_config(config)
        super().__init__(config)
        hidden, rank = config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, rank, hidden, config.markov_head_type)
        self.confidence_head = (ConfidenceHead(hidden, rank, config.confidence_head_with_markov)
                                if config.enable_confidence_head else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None) -> None:
        """The backbone's initialisation, and the heads' as DeepSpec and SpecForge start them: Normal(0, std)
        weights (the embedding too), zero biases."""
        super().reset_parameters(std)
        std = std if std is not None else float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()

    def heads(self) -> list[nn.Module]:
        return [self.markov_head] + ([self.confidence_head] if self.confidence_head is not None else [])

    def markov_logits(self, base_logits: torch.Tensor, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Slot logits corrected by the Markov head: base [..., V] + bias(prev [...], hidden [..., H])."""
        return base_logits + self.markov_head(prev_ids, hidden).to(base_logits.dtype)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logit for each slot [...] (fp32), or None without the head."""
        if self.confidence_head is None:
            return None
        embedded = self.markov_head.embed(prev_ids) if self.confidence_head.with_markov else None
        return self.confidence_head(hidden, embedded)
