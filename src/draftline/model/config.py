"""The drafter's configuration, derived from the target's.

The drafter is saved with ``model_type: "qwen3"`` and ``architectures: ["DFlashDraftModel"]`` so the
official DFlash code, SGLang and vLLM load it as it is; its config object is therefore a
``transformers.Qwen3Config`` carrying the DFlash fields (``block_size``, ``num_target_layers``,
``dflash_config``). This module builds that config from a target config and validates it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from draftline.config import ModelConfig, flag_of
from draftline.config_options import option
from draftline.errors import DraftlineError
from draftline.model.linear_attention import is_hybrid

# Fields copied from the target when the caller does not override them.
_SIZE_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)

# Rope fields of a target's attention that a Qwen3 drafter layer does not have (the drafter rotates
# whole heads with one frequency set, as the public drafters for these targets do).
TARGET_ONLY_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")

DEFAULT_DRAFT_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16

# Hybrid targets (Gated DeltaNet + full attention, Qwen3.5/3.6): the public DFlash drafter for them
# (z-lab's Qwen3.6-27B-DFlash) runs sliding-window layers and a last full-attention layer.
HYBRID_SLIDING_WINDOW = 2048

# ... and its attention is not the target's (gated 24 heads x 256 with 4 KV heads for the 27B): the public
# drafters for Qwen3.5/3.6 targets (SpecForge's configs/qwen3.6-27b-dflash.json, qwen3.5-4b-dflash.json,
# qwen3.5-35b-a3b-dflash.json) have 32 heads of 128, and 8 KV heads (4 for the MoE): a third fewer
# attention FLOPs per block row than the target's shape at 27B.
_HYBRID_ATTENTION = (("qwen3_5_moe", dict(num_attention_heads=32, head_dim=128, num_key_value_heads=4)),
                     ("qwen3_5", dict(num_attention_heads=32, head_dim=128, num_key_value_heads=8)))

# Mask tokens of known vocabularies: (model_type prefix, smallest vocab holding the token, token id).
# Qwen3's padded vocabulary has <|MASK|> at 151669; Qwen3.5/3.6's 248320-row one at 248070.
_MASK_TOKENS = (("qwen3_5", 248071, 248070), ("qwen3", 151670, 151669))

# Loss decay per block size from the DFlash paper; other sizes use block_size / 2.
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_target_layer_ids(num_target_layers: int, num_feature_layers: int) -> list[int]:
    """The z-lab rule: which target layers feed the drafter.

    ``[L // 2]`` for one layer, else ``round(1 + i * (L - 4) / (K - 1))`` for i in 0..K-1.
    Id ``l`` means the OUTPUT of target decoder layer ``l`` (HF ``hidden_states[l + 1]``).
    """
    if num_feature_layers < 1:
        raise DraftlineError(f"need at least one target feature layer, got {num_feature_layers}")
    if num_feature_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        raise DraftlineError(
            f"the target has {num_target_layers} layers; the default layer rule needs at least 5. "
            "Pass target_layer_ids explicitly (e.g. --target-layer-ids 0,1)."
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_feature_layers - 1)) for i in range(num_feature_layers)]


def default_loss_gamma(block_size: int) -> float:
    """Decay constant of the per-position loss weights exp(-(k-1)/gamma)."""
    return _PAPER_GAMMA.get(block_size, block_size / 2.0)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) target config."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def drafter_rope_parameters(target: PretrainedConfig) -> dict[str, Any]:
    """The target's RoPE settings a drafter layer takes (``TARGET_ONLY_ROPE`` left out)."""
    rope = getattr(target, "rope_parameters", None)
    if rope is None:  # transformers 4-style configs
        rope = dict(getattr(target, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = getattr(target, "rope_theta", 10000.0)
    rope = {k: v for k, v in rope.items() if k not in TARGET_ONLY_ROPE}
    if "rope_type" not in rope:
        raise DraftlineError(
            "the target config's rope_parameters is per layer type, which the DFlash drafter "
            "cannot copy; pass rope_parameters explicitly in the drafter overrides."
        )
    return copy.deepcopy(rope)


def build_drafter_config(
    target_config: PretrainedConfig,
    *,
    num_hidden_layers: int = DEFAULT_DRAFT_LAYERS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Qwen3Config:
    """The drafter config for ``target_config``; sizes default to the target's.

    ``overrides`` sets any Qwen3Config field (heads, intermediate size, rope, ...) by name. MoE
    targets without a dense ``intermediate_size`` get ``3 * hidden_size``. For a hybrid target
    the default layers are sliding-window attention (window ``HYBRID_SLIDING_WINDOW``) with a last
    full-attention layer, and the attention the public drafters have (``_HYBRID_ATTENTION``).
    """
    target = text_config(target_config)

    overrides = dict(overrides or {})
    if is_hybrid(target):
        model_type = getattr(target, "model_type", "") or ""
        shape = next((s for prefix, s in _HYBRID_ATTENTION if model_type.startswith(prefix)), None)
        if shape is not None:
            overrides = {**shape, **overrides}
    num_target_layers = int(target.num_hidden_layers)
    hidden_size = int(target.hidden_size)
    num_heads = int(overrides.get("num_attention_heads", target.num_attention_heads))
    head_dim = overrides.get("head_dim", getattr(target, "head_dim", None) or hidden_size // num_heads)
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
    if layer_types is None and is_hybrid(target) and num_hidden_layers > 1:
        layer_types = ["sliding_attention"] * (num_hidden_layers - 1) + ["full_attention"]
        sliding_window = sliding_window or HYBRID_SLIDING_WINDOW
    if layer_types is None:
        layer_types = ["full_attention"] * num_hidden_layers
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(target)
    check_layer_types(list(layer_types), num_hidden_layers, sliding_window)

    fields: dict[str, Any] = {name: getattr(target, name) for name in _SIZE_FIELDS}
    fields["num_attention_heads"] = num_heads
    fields["intermediate_size"] = getattr(target, "intermediate_size", None) or 3 * hidden_size
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = num_heads
    fields.update(
        hidden_size=hidden_size,
        head_dim=int(head_dim),
        vocab_size=int(target.vocab_size),
        num_hidden_layers=num_hidden_layers,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        rope_parameters=drafter_rope_parameters(target),
        tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
        layer_types=list(layer_types),
        use_sliding_window="sliding_attention" in layer_types,
        sliding_window=sliding_window,
        max_window_layers=0,
    )
    fields.update(overrides)
    dflash: dict[str, Any] = {"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)}
    for name in ("final_logit_softcapping",):
        if getattr(target, name, None):
            dflash[name] = float(getattr(target, name))
    config = Qwen3Config(**fields)
    config.architectures = ["DFlashDraftModel"]
    config.block_size = int(block_size)
    config.num_target_layers = num_target_layers
    config.dflash_config = dflash
    dtype = getattr(target_config, "dtype", None)
    if dtype is not None:
        config.dtype = dtype
    validate_drafter_config(config)
    return config


def default_mask_token_id(target: PretrainedConfig) -> int:
    """A row of the target's embedding to use as the mask token.

    Known vocabularies (``_MASK_TOKENS``): Qwen3's at 151669, Qwen3.5/3.6's at 248070. Elsewhere
    the caller should pass an id (a reserved or padding token of the target's tokenizer); without
    one we take the last row.
    """
    vocab_size = int(target.vocab_size)
    model_type = getattr(target, "model_type", "") or ""
    for prefix, min_vocab, token in _MASK_TOKENS:
        if model_type.startswith(prefix) and vocab_size >= min_vocab:
            return token
    return vocab_size - 1


def validate_drafter_config(config: Qwen3Config) -> None:
    """Raise DraftlineError naming the field and the fix if ``config`` is not a valid drafter."""
    dflash = getattr(config, "dflash_config", None) or {}
    block_size = getattr(config, "block_size", None)
    if not isinstance(block_size, int) or block_size < 2:
        raise DraftlineError(f"block_size must be an integer >= 2 (one anchor plus draft slots), got {block_size!r}")
    mask_id = dflash.get("mask_token_id")
    if not isinstance(mask_id, int) or not 0 <= mask_id < config.vocab_size:
        raise DraftlineError(
            f"dflash_config.mask_token_id={mask_id!r} is outside the target's vocabulary "
            f"[0, {config.vocab_size}); pick an unused row of the target's embedding, e.g. a reserved token."
        )
    ids = dflash.get("target_layer_ids")
    num_target_layers = getattr(config, "num_target_layers", None)
    if not ids or not all(isinstance(i, int) for i in ids):
        raise DraftlineError(f"dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
    if num_target_layers is not None and not all(0 <= i < num_target_layers for i in ids):
        raise DraftlineError(
            f"target_layer_ids {ids} must lie in [0, {num_target_layers}) (the target has "
            f"{num_target_layers} decoder layers; id l means the output of layer l)."
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise DraftlineError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    check_layer_types(list(config.layer_types or []), config.num_hidden_layers, config.sliding_window)


def check_layer_types(layer_types: list[str], num_layers: int, sliding_window: int | None) -> None:
    if len(layer_types) != num_layers:
        raise DraftlineError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}; give one per layer"
        )
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise DraftlineError(f"layer_types {unknown} unknown; use 'full_attention' or 'sliding_attention'")
    if "sliding_attention" in layer_types and not sliding_window:
        raise DraftlineError("a sliding_attention layer needs sliding_window (a positive number of positions)")


def check_matches_target(drafter: Qwen3Config, target_config: PretrainedConfig) -> None:
    """Raise DraftlineError if ``drafter`` cannot run on ``target_config`` (e.g. a warm start)."""
    target = text_config(target_config)
    problems = []
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.hidden_size} != target's {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.vocab_size} != target's {target.vocab_size}")
    num_target_layers = int(target.num_hidden_layers)
    ids = drafter.dflash_config.get("target_layer_ids", [])
    if any(i >= num_target_layers for i in ids):
        problems.append(f"target_layer_ids {ids} exceed the target's {num_target_layers} layers")
    if problems:
        raise DraftlineError(
            "the drafter does not match the target: " + "; ".join(problems)
            + ". The drafter shares the target's embedding, LM head and hidden size; train one for this target."
        )


def refuse_shape_flags(model: Any, drafter: Qwen3Config) -> None:
    """A warm start from a released drafter takes the drafter's own shape: a flag of the run's ``[model]``
    section (``draftline.config.ModelConfig``) that asks for another one is refused, not ignored."""
    has = {
        "draft_layers": drafter.num_hidden_layers,
        "block_size": drafter.block_size,
        "target_layer_ids": target_layer_ids(drafter),
        "mask_token_id": mask_token_id(drafter),
        "layer_types": list(drafter.layer_types or []),
        "sliding_window": drafter.sliding_window,
        **method_fields(drafter),
    }
    clash = [f"{_as_flag(name, getattr(model, name), listed=True)} (the drafter has {value})" for name, value in has.items()
             if getattr(model, name) is not None and getattr(model, name) != value]
    init = flag_of(model, "init_drafter")
    if clash:
        raise DraftlineError(
            f"{init} {model.init_drafter} fixes the drafter's shape, but " + "; ".join(clash)
            + f": drop these flags (the drafter's own values are used), or start without {init}")
    if model.init_from_target:
        raise DraftlineError(f"{init} and {flag_of(model, 'init_from_target')} both set the starting weights; pick one")


def refuse_changed_drafter(checkpoint: str | Path, config: Qwen3Config) -> None:
    """A resume continues the drafter ``checkpoint`` holds (its ``drafter/config.json``): a run whose flags
    or defaults resolve to another drafter ``config`` is refused, not trained on with another mask row
    or other feature layers. A checkpoint without that file is not compared."""
    saved_file = Path(checkpoint) / "drafter" / "config.json"
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    dflash = saved.get("dflash_config") or {}
    ours = method_fields(config)
    fields = {
        # a DSpark drafter keeps its mask token and feature layers at the top level (checkpoint.dspark_export)
        "mask_token_id": (dflash.get("mask_token_id", saved.get("mask_token_id")), mask_token_id(config)),
        "target_layer_ids": (dflash.get("target_layer_ids", saved.get("target_layer_ids")), target_layer_ids(config)),
        "block_size": (saved.get("block_size"), config.block_size),
        "draft_layers": (saved.get("num_hidden_layers"), config.num_hidden_layers),
        "layer_types": (saved.get("layer_types"), list(config.layer_types or [])),
        "sliding_window": (saved.get("sliding_window"), config.sliding_window),
        **{name: (had, ours.get(name)) for name, had in method_fields(saved).items()},
    }
    changed = [(name, had, now) for name, (had, now) in fields.items() if had is not None and had != now]
    if changed:
        raise DraftlineError(
            f"{checkpoint}: a resume continues the drafter this checkpoint holds, but this run resolves another: "
            + "; ".join(f"{_as_flag(name, now, listed=True)} (the checkpoint's drafter has {had})"
                        for name, had, now in changed)
            + ": resume with " + " ".join(_as_flag(name, had) for name, had, _ in changed)
            + ", or start a new run (--from-scratch, or another --out)")


def _as_flag(name: str, value: Any, *, listed: bool = False) -> str:
    """``ModelConfig.name`` set to ``value`` as the command line says it: ``--block-size 8``, a switch by itself
    (``--no-confidence-head``); ``None``: the flag left out. ``listed``: a list as Python writes it (in a message)."""
    declared = option(ModelConfig.__dataclass_fields__[name])
    if value is None:
        return f"no {declared.flag}"
    if isinstance(value, bool):
        return declared.flags[0] if value else declared.off
    return f"{declared.flag} {value if listed else _flag_value(value)}"


def method_fields(drafter: Any) -> dict[str, Any]:
    """The [model] fields (``draftline.config.ModelConfig``) a drafter config (object or config.json dict) fixes
    about its method: the method, and a DSpark drafter's heads."""
    from draftline.model.dspark import is_dspark_config

    get = drafter.get if isinstance(drafter, dict) else lambda name: getattr(drafter, name, None)
    if not is_dspark_config(drafter):
        return {"method": "dflash"}
    return {"method": "dspark", "markov_rank": get("markov_rank"), "markov_head_type": get("markov_head_type"),
            "confidence_head": get("enable_confidence_head"),
            "confidence_head_with_markov": get("confidence_head_with_markov")}


def _flag_value(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def target_layer_ids(config: Qwen3Config) -> list[int]:
    return list(config.dflash_config["target_layer_ids"])


def mask_token_id(config: Qwen3Config) -> int:
    return int(config.dflash_config["mask_token_id"])
