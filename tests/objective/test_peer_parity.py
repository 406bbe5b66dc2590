"""The DFlash objective against SpecForge 0.2.0's own code (installed --no-deps by the test set-up).

SpecForge's training wrapper (``OnlineDFlashModel``) and draft model (``DFlashDraftModel``) are
imported from its package and run on the very weights, features and anchors draftline's objective
sees: the two must give the same loss and the same gradient for every drafter tensor. Only the anchor
draw is handed over (the peer draws with ``torch.rand``); everything after it (noise blocks, positions,
masks, labels, decay weights, normalisation) is the peer's code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config

from draftline.data.batch import PackedBatch
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.objective.anchors import sample_anchors
from draftline.objective.blocks import build_blocks
from draftline.objective.loss import DFlashObjective, ObjectiveSettings

peer = pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                           reason="specforge==0.2.0 --no-deps (make test installs it)")

VOCAB, HIDDEN, BLOCK, MAX_ANCHORS = 96, 32, 6, 8


def _drafter_config(layer_types: list[str], window: int | None) -> Qwen3Config:
    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return build_drafter_config(target, num_hidden_layers=len(layer_types), block_size=BLOCK,
                                target_layer_ids=[1, 3, 4], layer_types=layer_types, sliding_window=window)


def _batch() -> PackedBatch:
    """Three conversations of different lengths, prompts unlabelled, one with a gap in its mask."""
    gen = torch.Generator().manual_seed(1)
    docs = []
    for length, prompt in ((31, 9), (12, 6), (40, 22)):
        ids = torch.randint(0, VOCAB - 1, (length,), generator=gen).tolist()
        mask = [i >= prompt for i in range(length)]
        docs.append((ids, mask))
    docs[2][1][30:33] = [False] * 3  # a second user turn inside the third conversation
    return PackedBatch.from_documents(docs)


def _peer_rows(batch: PackedBatch, features: torch.Tensor) -> dict:
    """The packed batch as the peer's padded rows: one conversation per row, zero-padded at the end."""
    width = int(batch.doc_lengths.max())
    rows = {"input_ids": torch.zeros(batch.num_docs, width, dtype=torch.long),
            "loss_mask": torch.zeros(batch.num_docs, width, dtype=features.dtype),
            "hidden_states": torch.zeros(batch.num_docs, width, features.shape[1], dtype=features.dtype)}
    for row, (start, length) in enumerate(zip(batch.doc_starts().tolist(), batch.doc_lengths.tolist())):
        rows["input_ids"][row, :length] = batch.input_ids[start:start + length]
        rows["loss_mask"][row, :length] = batch.loss_mask[start:start + length].to(features.dtype)
        rows["hidden_states"][row, :length] = features[start:start + length]
    return rows


def _hand_over_anchors(model, batch: PackedBatch, anchors: torch.Tensor) -> None:
    """Make the peer's anchor sampler return ``anchors`` (flat packed positions) in its own layout:
    per row, sorted, padded with position 0 and a keep flag of False."""
    doc = torch.bucketize(anchors, batch.doc_starts(), right=True) - 1
    per_row = [anchors[doc == d] - batch.doc_starts()[d] for d in range(batch.num_docs)]
    width = max(p.numel() for p in per_row)
    positions = torch.zeros(batch.num_docs, width, dtype=torch.long)
    keep = torch.zeros(batch.num_docs, width, dtype=torch.bool)
    for row, p in enumerate(per_row):
        positions[row, :p.numel()], keep[row, :p.numel()] = p, True

    def sample(seq_len, loss_mask, device):
        return positions.to(device), keep.to(device)

    model._sample_anchor_positions = sample


@pytest.mark.parametrize("gamma,layer_types,window", [
    (3.0, ["full_attention", "full_attention"], None),
    (1.0, ["full_attention", "full_attention"], None),
    (3.0, ["sliding_attention", "full_attention"], 7),  # sliding layers: causal in the block, a window on context
])
def test_loss_and_gradients_equal_specforges(gamma, layer_types, window):
    dtype = torch.float32  # the peer's eager softmax runs in fp32: in fp64 its masked -> fp32 -inf rows give NaN gradients
    config = _drafter_config(layer_types, window)
    torch.manual_seed(0)
    ours = DFlashDrafter(config).to(dtype)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, param in ours.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)

    peer_config = copy.deepcopy(config)
    peer_config._attn_implementation = "eager"  # its own masked path; flex_attention needs a GPU compile
    draft = peer.DFlashDraftModel(peer_config).to(dtype)
    missing, unexpected = draft.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("rotary_emb.") for k in missing)  # the same names, the z-lab layout

    gen = torch.Generator().manual_seed(2)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype) * 0.3
    batch = _batch()
    features = torch.randn(batch.num_tokens, 3 * HIDDEN, generator=gen, dtype=dtype)
    mask_id = int(config.dflash_config["mask_token_id"])

    objective = DFlashObjective(ours, embed, head, ObjectiveSettings(max_anchors=MAX_ANCHORS, gamma=gamma,
                                                                     attention="dense"))
    anchors = sample_anchors(batch, MAX_ANCHORS, 0)
    assert 8 < anchors.numel() < 3 * MAX_ANCHORS  # one conversation has fewer eligible positions than the cap
    blocks = build_blocks(batch, anchors, block_size=BLOCK, mask_token_id=mask_id, gamma=gamma)
    loss_sum, _ = objective(features, blocks)
    our_loss = loss_sum / blocks.label_weights.sum()
    our_loss.backward()

    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
    lm_head.weight.data.copy_(head)
    embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
    embed_tokens.weight.data.copy_(embed)
    model = peer.OnlineDFlashModel(draft, lm_head, embed_tokens, mask_id, block_size=BLOCK, attention_backend="eager",
                                   num_anchors=MAX_ANCHORS, loss_decay_gamma=gamma, objective_chunk_blocks=4)
    _hand_over_anchors(model, batch, anchors)
    rows = _peer_rows(batch, features)
    peer_loss, _, _ = model(input_ids=rows["input_ids"], hidden_states=rows["hidden_states"],
                            loss_mask=rows["loss_mask"])
    peer_loss.backward()

    torch.testing.assert_close(our_loss.detach(), peer_loss.detach(), rtol=1e-5, atol=0)
    peer_params = dict(draft.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, peer_params[name].grad, rtol=1e-4, atol=1e-7, msg=name)
