"""The DSpark drafter: its config, its heads (formulas, shapes, initialisation) and its forward pass against
SpecForge 0.2.0's ``DSparkDraftModel`` holding the same weights."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from draftline.errors import DraftlineError
from draftline.model.attention import BlockLayout, make_attention
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.dspark import build_dspark_config, is_dspark_config
from helpers import make_dspark_drafter, tiny_target_config


def test_config_fields_and_validation():
    base = build_drafter_config(tiny_target_config(), num_hidden_layers=2, block_size=7, target_layer_ids=[1, 3])
    config = build_dspark_config(base)
    assert config.architectures == ["Qwen3DSparkModel"] and config.block_size == 7
    assert (config.markov_rank, config.markov_head_type) == (256, "vanilla")
    assert config.enable_confidence_head and config.confidence_head_with_markov
    assert is_dspark_config(config) and is_dspark_config(config.to_dict()) and not is_dspark_config(base)
    assert base.architectures == ["DFlashDraftModel"]  # the DFlash config is not touched
    assert not build_dspark_config(base, confidence_head=False).confidence_head_with_markov
    with pytest.raises(DraftlineError, match="markov_rank"):
        build_dspark_config(base, markov_rank=0)
    with pytest.raises(DraftlineError, match="markov_head_type"):
        build_dspark_config(base, markov_head_type="rnn")


@pytest.mark.parametrize("kind,confidence,with_markov", [("vanilla", True, True), ("gated", True, False),
                                                         ("vanilla", False, False)])
def test_heads_parameters_and_their_start(kind, confidence, with_markov):
    torch.manual_seed(0)
    drafter = make_dspark_drafter(markov_head_type=kind, confidence_head=confidence, with_markov=with_markov,
                                  markov_rank=16, std=None)
    shapes = {n: tuple(t.shape) for n, t in drafter.state_dict().items() if n.startswith(("markov", "confidence"))}
    expected = {"markov_head.markov_w1.weight": (64, 16), "markov_head.markov_w2.weight": (64, 16)}
    if kind == "gated":
        expected.update({"markov_head.gate_proj.weight": (16, 32 + 16), "markov_head.gate_proj.bias": (16,)})
    if confidence:
        expected.update({"confidence_head.proj.weight": (1, 32 + (16 if with_markov else 0)),
                         "confidence_head.proj.bias": (1,)})
    assert shapes == expected
    # Normal(0, initializer_range = 0.02) weights, embedding included; zero biases (DeepSpec's and SpecForge's start).
    for name, tensor in drafter.state_dict().items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(tensor) == 0, name
        elif name.startswith("markov_head.") or name.endswith("proj.weight"):
            assert 0.012 < float(tensor.std()) < 0.03, name


def test_vanilla_and_gated_bias_formulas():
    for kind in ("vanilla", "gated"):
        drafter = make_dspark_drafter(markov_head_type=kind)
        head = drafter.markov_head
        prev = torch.tensor([3, 9, 3])
        hidden = torch.randn(3, 32)
        embedded = head.markov_w1.weight[prev]
        if kind == "gated":
            gate = torch.sigmoid(torch.cat([hidden, embedded], -1) @ head.gate_proj.weight.t() + head.gate_proj.bias)
            embedded = gate * embedded
        expected = embedded @ head.markov_w2.weight.t()
        torch.testing.assert_close(head(prev, hidden), expected)
        base = torch.randn(3, 64)
        torch.testing.assert_close(drafter.markov_logits(base, prev, hidden), base + expected)
        # ``apply`` hands the latent and W2 to a training loss inside the module's call.
        got = head(prev, hidden, apply=lambda latent, w2: latent @ w2.t())
        torch.testing.assert_close(got, expected)
    confidence = drafter.confidence_logits(hidden, prev)
    features = torch.cat([hidden, drafter.markov_head.markov_w1.weight[prev]], -1)
    proj = drafter.confidence_head.proj
    torch.testing.assert_close(confidence, (features @ proj.weight.t() + proj.bias).squeeze(-1))
    assert make_dspark_drafter(confidence_head=False).confidence_logits(hidden, prev) is None


def test_the_backbone_is_dflashs():
    """DSpark changes nothing of the backbone: with the same weights its hidden states are DFlash's."""
    drafter = make_dspark_drafter()
    plain = DFlashDrafter(drafter.config).float()
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith(("markov", "confidence"))})
    layout = BlockLayout(torch.zeros(10, dtype=torch.long), torch.arange(10), torch.zeros(2, dtype=torch.long),
                         torch.tensor([3, 7]), 4)
    args = (torch.randn(8, 32), torch.randn(10, 64), layout.block_positions(), torch.arange(10),
            make_attention(layout, drafter.config, "dense"))
    torch.testing.assert_close(drafter(*args), plain(*args), rtol=0, atol=0)


@pytest.mark.parametrize("kind,with_markov", [("vanilla", True), ("gated", True), ("vanilla", False)])
def test_forward_equals_specforges(kind, with_markov):
    """Backbone hidden states, Markov-corrected logits and confidence logits on the same weights, features,
    anchors and previous tokens: equal to SpecForge's within 1e-5 (fp32)."""
    pytest.importorskip("specforge.modeling.draft.dspark", reason="specforge==0.2.0 --no-deps (make test installs it)")
    from dspark_reference import specforge_drafter
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask

    drafter = make_dspark_drafter(markov_head_type=kind, with_markov=with_markov, block_size=4).eval()
    theirs = specforge_drafter(drafter).eval()
    torch.manual_seed(1)
    seq, block, hidden_size = 12, 4, 32
    anchors = torch.tensor([2, 5, 9])
    features = torch.randn(seq, 64)
    block_embeds = torch.randn(len(anchors) * block, hidden_size)
    layout = BlockLayout(torch.zeros(seq, dtype=torch.long), torch.arange(seq), torch.zeros(3, dtype=torch.long),
                         anchors, block)
    ours = drafter(block_embeds, features, layout.block_positions(), torch.arange(seq),
                   make_attention(layout, drafter.config, "dense"))
    mask = create_dflash_sdpa_mask(anchors[None], torch.ones(1, 3, dtype=torch.bool), seq, block, torch.device("cpu"))
    positions = torch.cat([torch.arange(seq), layout.block_positions()])[None]
    with torch.no_grad():
        reference = theirs(position_ids=positions, attention_mask=mask, noise_embedding=block_embeds[None],
                           target_hidden=features[None])[0]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)

    head = torch.randn(64, hidden_size)
    prev = torch.randint(0, 64, (len(anchors) * block,))
    base = F.linear(ours, head)
    with torch.no_grad():
        ref_logits = theirs.apply_logits_head(F.linear(reference, head)[None], prev_token_ids=prev[None],
                                              hidden_states=reference[None])[0]
        ref_confidence = theirs.predict_confidence(reference[None], prev_token_ids=prev[None])[0]
    torch.testing.assert_close(drafter.markov_logits(base, prev, ours), ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.confidence_logits(ours, prev), ref_confidence, rtol=1e-5, atol=1e-5)
