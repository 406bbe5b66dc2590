"""Our one-pass training forward against the official DFlash code, block by block.

For every anchor of a packed batch (several documents in one row, a sliding-window layer among
full-attention ones), the logits of our single attention pass over all blocks must equal those of
the official ``DFlashDraftModel`` (loaded with its own ``from_pretrained`` from our exported
checkpoint) run on that block alone with the context before its anchor.
"""

from __future__ import annotations

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model", reason="the official dflash package (test dependency)")

from draftline.checkpoint.export import save_drafter  # noqa: E402
from draftline.data.batch import PackedBatch  # noqa: E402
from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.model.drafter import DFlashDrafter  # noqa: E402
from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config  # noqa: E402
from draftline.objective.loss import DFlashObjective, ObjectiveSettings  # noqa: E402


def random_packed_batch(vocab: int, lengths: list[int], seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for length in lengths:
        ids = torch.randint(0, vocab - 1, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, max(2, length // 3), (1,), generator=g))
        mask = [i >= prompt for i in range(length)]
        docs.append((ids, mask))
    return PackedBatch.from_documents(docs, sample_ids=[10 + i for i in range(len(docs))])


def build(target_dir, *, layer_types, sliding_window, block_size, num_layers=3, std=0.1, seed=0):
    target_config = load_target_config(target_dir)
    config = build_drafter_config(
        target_config,
        num_hidden_layers=num_layers,
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).float()
    drafter.reset_parameters(std=std)
    return drafter


@pytest.mark.parametrize(
    "layer_types,window,block",
    [
        (["full_attention", "sliding_attention", "full_attention"], 5, 6),
        (["full_attention", "full_attention", "full_attention"], None, 4),
    ],
)
def test_one_pass_logits_equal_official_per_block(qwen3_target, tmp_path, layer_types, window, block):
    drafter = build(qwen3_target, layer_types=layer_types, sliding_window=window, block_size=block)
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    official = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=torch.float32).eval()
    assert official.target_layer_ids == drafter.target_layer_ids

    target = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float32)
    batch = random_packed_batch(embed.shape[0], [23, 9, 31], seed=1)
    features = target(batch)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=6, seed=3, attention="dense"))
    blocks = objective.blocks(batch)
    assert blocks.num_anchors >= 10
    with torch.no_grad():
        ours = objective.hidden(features, blocks) @ head.t()  # [N * B, V]

    starts = batch.doc_starts()
    head_module = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    head_module.weight.data.copy_(head)
    worst = 0.0
    for a in range(blocks.num_anchors):
        doc = int(blocks.layout.anchor_doc[a])
        pos = int(blocks.layout.anchor_pos[a])
        start = int(starts[doc])
        context = features[start : start + pos][None]
        ids = blocks.block_input_ids[a * block : (a + 1) * block][None]
        with torch.no_grad():
            out = official(
                target_hidden=context,
                noise_embedding=torch.nn.functional.embedding(ids, embed),
                position_ids=torch.arange(pos + block)[None],
            )
            reference = official.compute_logits(out, head_module)[0]
        mine = ours[a * block : (a + 1) * block]
        err = ((mine - reference).norm() / reference.norm()).item()
        worst = max(worst, err)
    assert worst < 1e-4, worst


def test_target_features_are_layer_outputs_per_document(qwen3_target):
    """Feature id l is HF hidden_states[l + 1] (output of layer l), and documents do not mix."""
    from transformers import AutoModelForCausalLM

    layer_ids = [1, 3, 7]  # 7 is the last layer: HF's hidden_states[8] is after the final norm
    target = TargetFeatures(qwen3_target, layer_ids, dtype=torch.float32)
    full = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    batch = random_packed_batch(320, [12, 7, 15], seed=4)
    packed = target(batch)
    starts, lengths = batch.doc_starts().tolist(), batch.doc_lengths.tolist()
    for start, length in zip(starts, lengths):
        ids = batch.input_ids[start : start + length][None]
        with torch.no_grad():
            states = full(ids, output_hidden_states=True).hidden_states
        expected = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(packed[start : start + length], expected, rtol=1e-4, atol=1e-4)
    # The truncated target holds only the layers it needs.
    assert len(target.decoder.layers) == max(layer_ids) + 1
