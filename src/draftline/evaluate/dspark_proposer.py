"""DSpark's drafting step for ``evaluate.speculative``: one parallel pass, then the Markov head slot by slot.

With ``x_s`` the last committed token (DeepSpec's ``eval/dspark/draft_ops.py``, read for the facts):

    hidden   drafter([x_s, MASK x (B-1)] | features of x_<s)  -> h_0 .. h_{B-1}   (one pass, as DFlash)
    base     U_k = head(h_k)                                   (the target's LM head)
    slots    logits_k = U_k + W2 latent(x_{k-1}, h_k),  x_{-1} = x_s; d_{k+1} = argmax, or a draw from
             softmax(logits_k) under the sampling settings (those distributions go to rejection sampling)

so slot k drafts the token at position s + k + 1 and the block gives B drafts, verified as
``[x_s, d_1 .. d_B]``. The full block runs even where fewer drafts are wanted (near ``max_new_tokens``): a
slot's hidden state depends on the whole block, as in training. The confidence head's probabilities of each
proposal are kept (``last_confidence``; ``confidences``, one tensor per cycle since the last ``reset``) for the
calibration report (``evaluate.acceptance.confidence_calibration``); drafting does not stop on them (the paper's
offline numbers do not).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftline.evaluate.sampling import Sampling, probabilities
from draftline.evaluate.speculative import DFlashProposer
from draftline.model.dspark import DSparkDrafter


class DSparkProposer(DFlashProposer):
    """Our DSpark drafter wired to the target (a ``speculative.TokenProposer``)."""

    def __init__(self, drafter: DSparkDrafter, target: PreTrainedModel):
        super().__init__(drafter, target)
        self.num_drafts = drafter.block_size
        self.confidences: list[torch.Tensor] = []
        self.last_confidence: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.confidences = []
        self.last_confidence = None

    def propose(self, anchor: torch.Tensor, anchor_pos: int, new_features: torch.Tensor, num_drafts: int,
                sampling: Sampling, generator: torch.Generator | None = None):
        block = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=new_features.device)
        block[0] = anchor
        hidden = self.block_hidden(block, anchor_pos, new_features)[:num_drafts]  # [g, H]
        drafts, probs = self.draw(self.head_logits(hidden), hidden, block[0], sampling, generator)
        previous = torch.cat([block[:1], drafts[:-1]])
        confidence = self.drafter.confidence_logits(hidden, previous)
        self.last_confidence = None if confidence is None else confidence.sigmoid()
        if confidence is not None:
            self.confidences.append(self.last_confidence)
        return drafts, probs

    def draw(self, base: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, sampling: Sampling,
             generator: torch.Generator | None):
        """Slot by slot: the Markov-corrected logits of slot k from the draft before it (the anchor for slot 0),
        then its draft. base [g, V], hidden [g, H] -> (drafts [g], their distributions [g, V] or None)."""
        drafts = torch.empty(base.shape[0], dtype=torch.long, device=base.device)
        probs = []
        prev = anchor
        for k in range(base.shape[0]):
            logits = self.drafter.markov_logits(base[k], prev, hidden[k])
            if sampling.greedy:
                drafts[k] = logits.argmax()
            else:
                probs.append(probabilities(logits, sampling))
                drafts[k] = torch.multinomial(probs[-1], 1, generator=generator)[0]
            prev = drafts[k]
        return drafts, (torch.stack(probs) if probs else None)
