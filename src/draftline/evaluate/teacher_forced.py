"""Acceptance without decoding: the drafter teacher-forced on known continuations, two ways.

For every response position p, one forward over all blocks gives the block's teacher-forced
acceptance length ``a(p) = 1 + (leading slots predicted right)``. Then:

- ``uniform``: the mean of a(p) over all positions. This is what the training monitor's
  ``tf_acceptance`` estimates (its anchors are drawn uniformly). It overstates decoding: a block
  at a uniform position often starts inside an easy run that decoding would have skipped.
- ``chained``: the mean of a(p) over the blocks greedy decoding runs: the first at the response's
  start, each next at ``p + a(p)`` (right after a rejection). When the continuation is the
  target's own greedy output, decoding sees exactly these blocks and contexts, so this IS the
  measured tau (up to floating-point ties and the last block, cut at the response's end).
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftline.data.batch import PackedBatch
from draftline.model.drafter import DFlashDrafter
from draftline.objective.anchors import chained_block_starts, eligible_anchors
from draftline.objective.blocks import build_blocks
from draftline.objective.loss import DFlashObjective, ObjectiveSettings


@torch.no_grad()
def block_acceptance(features: torch.Tensor, objective: DFlashObjective, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors, acceptance length of a block at each) for every eligible anchor of ``batch``.

    ``features`` are the target's fused features of ``batch`` [T, K * H]; anchors are flat token
    indices, sorted; lengths are int64 in 1..B (a slot without a label counts as a miss).
    """
    anchors = eligible_anchors(batch)
    block_size = objective.block_size
    if anchors.numel() == 0:
        return anchors, torch.zeros(0, dtype=torch.long)
    blocks = build_blocks(batch, anchors, block_size=block_size, mask_token_id=objective.mask_token_id,
                          gamma=objective.gamma).to(features.device)
    hidden = objective.hidden(features, blocks)[blocks.label_rows]
    logits = hidden.to(objective.head_weight.dtype) @ objective.head_weight.t()
    hits = torch.zeros(anchors.numel() * block_size, dtype=torch.bool, device=features.device)
    hits[blocks.label_rows] = logits.argmax(-1) == blocks.labels
    hits = hits.view(-1, block_size)[:, 1:].long()
    return anchors, (1 + torch.cumprod(hits, dim=1).sum(dim=1)).cpu()


def teacher_forced_acceptance(
    target_model,
    drafter: DFlashDrafter,
    sequences: Sequence[tuple[Sequence[int], int]],
) -> dict:
    """Uniform and chained teacher-forced acceptance of ``drafter`` on ``(token ids, prompt length)``
    pairs (the continuation after the prompt is the one scored; see the module docstring).

    ``target_model`` is a whole causal LM (it is not modified). Returns ``uniform``, ``chained``,
    ``num_positions``, ``num_blocks`` and ``chained_lengths`` (per sequence, the chained blocks'
    acceptance lengths: what decoding would commit at each step).
    """
    from draftline.model.target import TargetFeatures

    docs = []
    for ids, prompt_len in sequences:
        ids = list(ids)
        docs.append((ids, [i >= prompt_len for i in range(len(ids))]))
    batch = PackedBatch.from_documents(docs)
    layers = target_model.get_decoder().layers
    hooks_before = [set(layer._forward_hooks) for layer in layers]
    embed = target_model.get_input_embeddings().weight
    head = target_model.get_output_embeddings().weight
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(attention="dense"))
    was_training = drafter.training
    drafter.eval()
    try:
        features = TargetFeatures.from_model(target_model, drafter.target_layer_ids, keep_all_layers=True)
        anchors, lengths = block_acceptance(features(batch), objective, batch)
    finally:
        drafter.train(was_training)
        for layer, before in zip(layers, hooks_before):  # the feature hooks go: the model is left as it was
            for key in set(layer._forward_hooks) - before:
                del layer._forward_hooks[key]
    doc_of_anchor = batch.doc_ids()[anchors]
    chained = []
    for doc in range(batch.num_docs):
        mine = lengths[doc_of_anchor == doc]
        # Eligible positions of a prompt + response run consecutively: one chain per document.
        chained.append(mine[chained_block_starts(mine)].tolist() if mine.numel() else [])
    num_blocks = sum(len(c) for c in chained)
    return {
        "uniform": float(lengths.double().mean()) if lengths.numel() else float("nan"),
        "chained": sum(map(sum, chained)) / num_blocks if num_blocks else float("nan"),
        "num_positions": int(lengths.numel()),
        "num_blocks": num_blocks,
        "chained_lengths": chained,
    }
