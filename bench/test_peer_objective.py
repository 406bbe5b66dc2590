"""SpecForge's own DFlash objective against ours on the same weights, features and anchors.

bench/peer_objective.py trains the peer's code on draftline's batches; this checks that with the very
same blocks (``--anchors ours``) the two objectives compute the same loss and the same gradients, so
that any difference in the trained drafters comes from the settings (init, gamma, betas, numerics,
the anchor draw), not from a different objective. Needs the ``bench`` extra (specforge, --no-deps).
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("specforge.algorithms.common.dflash_family_model", reason="the bench extra (specforge --no-deps)")

from draftline.data.batch import PackedBatch  # noqa: E402
from draftline.demo.pipeline import TARGET  # noqa: E402
from draftline.model.drafter import DFlashDrafter  # noqa: E402
from draftline.model.target import load_embedding_and_head  # noqa: E402
from draftline.objective.anchors import sample_anchors  # noqa: E402
from draftline.objective.blocks import build_blocks  # noqa: E402
from draftline.objective.loss import DFlashObjective, ObjectiveSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]  # run by hand: pytest bench/test_peer_objective.py (the bench extra)


def _peer_module():
    spec = importlib.util.spec_from_file_location("peer_objective", REPO / "bench" / "peer_objective.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(vocab: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(1)
    docs = []
    for length, prompt in ((40, 12), (23, 9), (57, 30)):  # a short document has fewer anchors than the cap
        ids = torch.randint(4, vocab, (length,), generator=gen).tolist()
        mask = [i >= prompt for i in range(length)]
        docs.append((ids, mask))
    return PackedBatch.from_documents(docs, sample_ids=[7, 3, 11])


@pytest.mark.parametrize("gamma", [4.0, 1.0])
def test_peer_loss_and_gradients_equal_ours_on_the_same_blocks(gamma):
    peer = _peer_module()
    args = types.SimpleNamespace(target=TARGET, draft_layers=3, block_size=8, max_anchors=16, lr=6e-4,
                                 grad_clip=1.0, warmup_ratio=0.04, peer_gamma=gamma, peer_dtype="float32", seed=0,
                                 data=None, token_budget=32768, max_batch_size=8, epochs=1, target_layer_ids=None,
                                 max_steps=None)
    from draftline.pipeline.spec import ModelSpec

    ours_cfg = ModelSpec.resolve(peer.draftline_config(args)).drafter_config
    model, _, _ = peer.build_peer(args, int(ours_cfg.dflash_config["mask_token_id"]), total_steps=10)
    assert list(model.draft_model.target_layer_ids) == ours_cfg.dflash_config["target_layer_ids"]
    drafter = DFlashDrafter(ours_cfg).float()
    state = {k: v for k, v in model.draft_model.state_dict().items() if not k.startswith("rotary_emb.")}
    drafter.load_state_dict(state, strict=True)  # the same weights, under the same names (the z-lab layout)

    batch = _batch(int(ours_cfg.vocab_size))
    hidden = ours_cfg.hidden_size
    features = torch.randn(batch.num_tokens, 3 * hidden, generator=torch.Generator().manual_seed(2))

    # the peer, its own code, on draftline's anchor draw
    peer.our_anchor_draw(model, batch, args.max_anchors, seed=0)
    rows = peer.padded_rows(batch, features, torch.float32)
    model.draft_model.zero_grad()
    peer_loss, _, _ = model(input_ids=rows["input_ids"], hidden_states=rows["hidden_states"], loss_mask=rows["loss_mask"])
    peer_loss.backward()

    # ours
    embed, head = load_embedding_and_head(TARGET, device="cpu", dtype=torch.float32)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=16, gamma=gamma, attention="dense"))
    anchors = sample_anchors(batch, 16, 0)
    blocks = build_blocks(batch, anchors, block_size=8, mask_token_id=objective.mask_token_id, gamma=gamma)
    loss_sum, _ = objective(features, blocks)
    (loss_sum / blocks.label_weights.sum()).backward()

    assert anchors.numel() == 16 + 13 + 16  # the 23-token document has 13 eligible positions, fewer than the cap
    torch.testing.assert_close(loss_sum / blocks.label_weights.sum(), peer_loss.detach(), rtol=1e-5, atol=1e-6)
    peer_grads = dict(model.draft_model.named_parameters())
    for name, param in drafter.named_parameters():
        torch.testing.assert_close(param.grad, peer_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
