"""A DSpark drafter's config.json, in the layout DeepSpec writes and SGLang's and vLLM's DSpark loaders read.

``architectures: ["Qwen3DSparkModel"]``, ``model_type: "qwen3"``, the Qwen3 sizes, and at the TOP level:
``block_size`` (B: the block's inputs and its drafted tokens; SGLang's gamma, vLLM's num_speculative_tokens),
``num_target_layers``, ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``. No ``dflash_config``: both engines read it before the
top-level fields, so it could only disagree with them. ``model.safetensors`` (``checkpoint.export``) holds the
backbone's tensors, ``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r] (and
``markov_head.gate_proj.{weight,bias}`` for the gated head), ``confidence_head.proj.{weight,bias}`` when the
head is on; no embedding or LM head (the engines take the target's).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3Config

from draftline.errors import DraftlineError
from draftline.model.config import validate_drafter_config
from draftline.model.dspark import DSPARK_ARCHITECTURE, DSPARK_FIELDS, validate_dspark_config

TOP_LEVEL = ("block_size", "num_target_layers", "target_layer_ids", "mask_token_id", *DSPARK_FIELDS)


def dspark_config_dict(config: Qwen3Config, dtype) -> dict:
    """config.json content of a DSpark drafter, in a stable order."""
    data = config.to_dict()
    dflash = dict(data.pop("dflash_config", None) or getattr(config, "dflash_config", {}) or {})
    data["architectures"] = [DSPARK_ARCHITECTURE]
    data["model_type"] = "qwen3"
    data["dtype"] = str(dtype).removeprefix("torch.")
    data.pop("torch_dtype", None)
    data["target_layer_ids"] = list(dflash.pop("target_layer_ids"))
    data["mask_token_id"] = int(dflash.pop("mask_token_id"))
    if dflash:  # a target's logit scaling: DSpark's engine loaders read none of it
        raise DraftlineError(f"the drafter's dflash_config has {sorted(dflash)}: the DSpark export writes no "
                             "dflash_config and the engines' DSpark drafting applies the LM head without them")
    for name in ("block_size", "num_target_layers", *DSPARK_FIELDS):
        data[name] = getattr(config, name)
    return dict(sorted(data.items()))


def dspark_config_from_json(data: dict, config_file: Path) -> Qwen3Config:
    """The drafter config a DSpark config.json describes (the model's own layout: ``dflash_config`` inside)."""
    for name in ("block_size", "target_layer_ids", "mask_token_id", *DSPARK_FIELDS):
        if name not in data:
            raise DraftlineError(f"{config_file}: field {name!r} missing; a DSpark drafter config has it at the top "
                                 "level (export the drafter with draftline export)")
    if "dflash_config" in data:
        raise DraftlineError(f"{config_file}: a DSpark drafter config with a dflash_config: the engines read its "
                             "mask_token_id and target_layer_ids before the top-level ones; remove it")
    config = Qwen3Config.from_dict({
        **{k: v for k, v in data.items() if k not in TOP_LEVEL},
        "block_size": data["block_size"],
        "num_target_layers": data.get("num_target_layers") or max(data["target_layer_ids"]) + 1,
        "dflash_config": {"mask_token_id": data["mask_token_id"], "target_layer_ids": list(data["target_layer_ids"])},
        **{name: data[name] for name in DSPARK_FIELDS},
        "architectures": [DSPARK_ARCHITECTURE],
    })
    validate_drafter_config(config)
    validate_dspark_config(config)
    return config
