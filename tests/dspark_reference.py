"""SpecForge 0.2.0's DSpark code (installed --no-deps by the test set-up) holding our drafter's weights."""

from __future__ import annotations

import torch


def specforge_config(config):
    """The config SpecForge's ``DSparkDraftModel`` reads for our DSpark drafter config: the heads' fields in
    ``dflash_config`` (SpecForge's place for them), the rest as it is."""
    from transformers import Qwen3Config

    theirs = Qwen3Config.from_dict(config.to_dict())
    theirs.block_size = config.block_size
    theirs.num_target_layers = config.num_target_layers
    attention_mode = "gqa" if config.num_key_value_heads < config.num_attention_heads else "mha"
    theirs.dflash_config = {
        "target_layer_ids": list(config.dflash_config["target_layer_ids"]),
        "mask_token_id": int(config.dflash_config["mask_token_id"]),
        "markov_rank": config.markov_rank, "markov_head_type": config.markov_head_type,
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov, "attention_mode": attention_mode,
    }
    theirs._attn_implementation = "sdpa"
    return theirs


def specforge_drafter(drafter, state_dict=None):
    """SpecForge's ``DSparkDraftModel`` built from our drafter's config, every tensor loaded by name (strict)."""
    from specforge.modeling.draft.dspark import DSparkDraftModel

    model = DSparkDraftModel(specforge_config(drafter.config)).float()
    model.load_state_dict(state_dict if state_dict is not None else drafter.state_dict(), strict=True)
    return model


def specforge_online(model, embed, head, *, block_size, gamma, anchors, chunk_blocks=0, **weights):
    """SpecForge's ``OnlineDSparkModel`` (its training loss) around ``model``, with the anchors fixed to
    ``anchors`` (token positions of one row) instead of its random draw."""
    from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel

    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    lm_head.weight.data.copy_(head)
    embed_tokens = torch.nn.Embedding(embed.shape[0], embed.shape[1])
    embed_tokens.weight.data.copy_(embed)
    lm_head.requires_grad_(False)
    embed_tokens.requires_grad_(False)
    online = OnlineDSparkModel(model, lm_head, embed_tokens, model.mask_token_id, block_size=block_size,
                               attention_backend="sdpa", num_anchors=len(anchors), loss_decay_gamma=gamma,
                               objective_chunk_blocks=chunk_blocks, **weights)
    fixed = torch.tensor([list(anchors)])
    keep = torch.ones_like(fixed, dtype=torch.bool)
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: (fixed, keep)
    return online
