"""The rules on a drafter's config.json, against the target's config and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from draftline.checkpoint.serving.findings import (
    MIXED_LAYERS_WARNING, SGLANG, SGLANG_DEFAULT_MASK_TOKEN, SPECULATORS, VLLM, ServingCheck,
)
from draftline.errors import DraftlineError
from draftline.model.config import TARGET_ONLY_ROPE, drafter_rope_parameters

# Config fields that make an engine build a drafter other than the one draftline trains, with the
# value draftline trains with (None: the field must be absent) and who reads it. The field is the rule id.
_SWITCHES: tuple[tuple[str, Any, str], ...] = (
    ("is_causal", None, f"{VLLM} and {SGLANG} make every layer causal or non-causal by it"),
    ("dflash_config.causal", None, f"{VLLM} sets every layer's causality by it"),
    ("dflash_config.use_swa", False, f"{VLLM} turns every layer into sliding-window attention"),
    ("is_neox_style", True, f"{VLLM} (and {SGLANG} without rope_is_neox_style) rotates interleaved pairs when it is "
                            "false; draftline rotates halves"),
    ("rope_is_neox_style", True, f"{SGLANG} rotates interleaved pairs when it is false; draftline rotates halves"),
    ("use_gemma_norm", False, f"{SGLANG} builds Gemma-style (1 + w) norms"),
    ("attention_bias", False, "draftline's projections have no bias; the engines would build biases no tensor fills"),
    ("hidden_act", "silu", "draftline's MLP is SiLU-gated; the engines build the MLP with this activation"),
    ("dflash_config.attention_value_scale", None, f"{VLLM} and {SGLANG} scale the attention values by it"),
    ("dflash_config.conv_kernel_size", 0, f"{SGLANG} adds grouped convolutions around attention and MLP"),
    ("dflash_config.selector_rank", 0, f"draftline trains no candidate selector; {SGLANG} builds one from "
                                       "selector_rank and selector_top_k for DFlash2DraftModel and refuses one "
                                       "without the other at start"),
    ("dflash_config.selector_top_k", 0, f"draftline trains no candidate selector; {SGLANG} builds one from "
                                        "selector_rank and selector_top_k for DFlash2DraftModel and refuses one "
                                        "without the other at start"),
)


def check_config(data: dict, target_dir: Path | None, target: PretrainedConfig, check: ServingCheck) -> None:
    parsed_data = parsed(data)
    _check_format(data, check)
    check_switches(data, check)
    _check_resolved(data, check)
    _check_rope(data, parsed_data, target, check)
    check_against_target(data, target, check)
    check_layers(data, parsed_data, target, check)
    if target_dir is not None:
        _check_tokenizer(data, target_dir, check)


def _get(data: dict, dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _section(data: dict, name: str) -> dict:
    value = data.get(name)
    return value if isinstance(value, dict) else {}


def dflash_section(data: dict) -> dict:
    return _section(data, "dflash_config")


def parsed(data: dict):
    """config.json as transformers' Qwen3 config reads it (both engines parse it with transformers 5:
    it derives layer_types when absent, drops sliding_window unless use_sliding_window is true, and
    moves rope fields into rope_parameters); None where it does not parse."""
    from transformers import Qwen3Config

    fields = {k: v for k, v in data.items() if k not in ("block_size", "num_target_layers", "dflash_config")}
    try:
        return Qwen3Config.from_dict(fields)
    except Exception:  # noqa: BLE001 - its validators raise their own error types; the raw fields are then checked
        return None


def _check_format(data: dict, check: ServingCheck) -> None:
    add = check.add
    if data.get("architectures") != ["DFlashDraftModel"]:
        add("architectures", "architectures", f"is {data.get('architectures')!r}; both engines pick their DFlash "
            "model class by it (vLLM's registry, SGLang's model classes), and other names build other drafters",
            'set "architectures": ["DFlashDraftModel"]')
    if data.get("model_type") != "qwen3":
        add("model_type", "model_type", f"is {data.get('model_type')!r}; the engines parse config.json with the "
            "config class of this type, and draftline trains a Qwen3-layer drafter", 'set "model_type": "qwen3"')
    if not isinstance(data.get("dflash_config"), dict):
        add("dflash_config", "dflash_config", "missing; it holds mask_token_id and target_layer_ids",
            "export the drafter with draftline export")
    block_size = data.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        add("block_size", "block_size", f"is {block_size!r}; it must be an integer >= 2 (one anchor plus draft "
            "slots)", "set the block size the drafter was trained with")
    dflash = dflash_section(data)
    for name in ("block_size", "num_target_layers"):
        if name in dflash and dflash[name] != data.get(name):
            add(f"dflash_config.{name}", f"dflash_config.{name}", f"is {dflash[name]!r} but the top-level {name} "
                f"is {data.get(name)!r}; {SGLANG} reads dflash_config's, draftline and the official code the "
                "top-level one", f"remove dflash_config.{name}")
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        add("dflash_config.mask_token_id", "dflash_config.mask_token_id", f"is {mask!r}; without an integer id "
            f"{SGLANG} resolves the mask token from the tokenizer instead of the row the drafter was trained with",
            "set the embedding row the drafter was trained with")


def check_switches(data: dict, check: ServingCheck) -> None:
    for name, trained, reader in _SWITCHES:
        value = _get(data, name)
        if value is None or value == trained or (trained in (False, 0) and not value):
            continue
        fix = f'set it to {json.dumps(trained)} or remove it' if trained not in (None, False, 0) else f"remove {name}"
        check.add(name, name, f"is {value!r}: {reader}", fix)
    window = dflash_section(data).get("swa_window_size")
    if window is not None and window != data.get("sliding_window"):
        check.add("dflash_config.swa_window_size", "dflash_config.swa_window_size",
                  f"is {window!r} but sliding_window is {data.get('sliding_window')!r}; {VLLM} takes the window from "
                  f"swa_window_size, {SGLANG} and draftline from sliding_window", "remove dflash_config.swa_window_size")


def _first_set(data: dict, name: str, sections: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(field, value)`` of the first of ``sections`` ("" for the top level) that has ``name``, in an
    engine's order of precedence; None where none has it."""
    for section in sections:
        holder = _section(data, section) if section else data
        if name in holder:
            return (f"{section}.{name}" if section else name), holder[name]
    return None


def _check_resolved(data: dict, check: ServingCheck) -> None:
    """Fields an engine reads from more than one place: the one it reads decides."""
    found = _first_set(data, "use_aux_hidden_state", ("dflash_config", "eagle_config", ""))
    if found is not None and not found[1]:
        check.add("use_aux_hidden_state", found[0], f"is {found[1]!r}: {VLLM} (which reads dflash_config's, "
                  "else eagle_config's, else the top-level one) drops fc and the target features",
                  f"remove {found[0]}")
    sink = dflash_section(data).get("attention_sink_bias")
    if sink:
        check.add("dflash_config.attention_sink_bias", "dflash_config.attention_sink_bias",
                  f"is {sink!r}: {VLLM} and {SGLANG} add per-head attention sinks", "remove dflash_config.attention_sink_bias")
    elif "attention_sink_bias" not in dflash_section(data) and data.get("add_swa_attention_sink_bias"):
        check.add("add_swa_attention_sink_bias", "add_swa_attention_sink_bias",
                  f"is {data['add_swa_attention_sink_bias']!r}: {VLLM} adds per-head attention sinks (it reads this "
                  "when dflash_config has no attention_sink_bias)", "remove add_swa_attention_sink_bias")
    found = _first_set(data, "projector_type", ("dflash_config", ""))
    if found is not None and found[1] is not None:
        check.add("projector_type", found[0], f"is {found[1]!r}: {SGLANG} reads dflash_config's, else the top-level "
                  "one, and for 'domino' builds a GRU projector and refuses a drafter without its tensors; draftline "
                  "trains no projector", f"remove {found[0]}")
    found = _first_set(data, "mask_token", ("dflash_config", ""))
    if found is not None and found[1] is not None and (not isinstance(found[1], str) or not found[1]):
        check.add("mask_token", found[0], f"is {found[1]!r}: {SGLANG} refuses a mask token that is not a non-empty "
                  "string at start", f"remove {found[0]}")
    for name in ("quantization_config", "compression_config"):
        if data.get(name) is not None:
            check.add("quantization", name, f"is set: {VLLM} and {SGLANG} build the drafter's linear layers for the "
                      "quantization it describes; draftline writes the weights unquantized", f"remove {name}")


def _check_rope(data: dict, parsed, target: PretrainedConfig, check: ServingCheck) -> None:
    rope = getattr(parsed, "rope_parameters", None) if parsed is not None else data.get("rope_parameters")
    if not isinstance(rope, dict) or ("rope_type" not in rope and "rope_theta" not in rope):
        return  # per layer type, or none: transformers' own validation names it when the drafter is built
    heads = data.get("num_attention_heads") or 1
    head_dim = data.get("head_dim") or (data.get("hidden_size") or 0) // heads
    rope_dim = rope.get("rope_dim")
    if rope_dim is not None and rope_dim != head_dim:
        check.add("rope_parameters.rope_dim", "rope_parameters.rope_dim", f"is {rope_dim!r}: {VLLM} and {SGLANG} "
                  f"rotate that many dimensions of each head; draftline rotates all {head_dim}",
                  "remove rope_parameters.rope_dim")
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor != 1.0 and rope_dim is None:
        check.add("rope_parameters.partial_rotary_factor", "rope_parameters.partial_rotary_factor",
                  f"is {factor!r} (transformers moves a top-level one there): {VLLM} rotates that fraction of each "
                  "head; draftline's RoPE rotates whole heads", "remove partial_rotary_factor")
    if "mrope_section" in rope:
        check.warn("rope_parameters.mrope_section", f"rope_parameters.mrope_section is {rope['mrope_section']!r}: "
                   f"{VLLM}'s V1 model runner refuses a DFlash drafter with M-RoPE sections at start (its V2 runner "
                   "gives the drafter 1-D positions, which M-RoPE rotates as plain RoPE, as draftline does); remove it")
    try:
        targets = drafter_rope_parameters(target)
    except DraftlineError:
        return
    own = dict(sorted((k, v) for k, v in rope.items() if k not in TARGET_ONLY_ROPE))
    targets = dict(sorted(targets.items()))
    if own != targets:
        check.warn("rope_parameters.target", f"rope_parameters {own} differ from the target's {targets} (the fields "
                   f"a drafter does not take left out): {VLLM} and {SGLANG} rotate the drafter's queries and the "
                   "target features' keys with the drafter's own, as draftline trains; a drafter is usually trained "
                   "with its target's")


def check_against_target(data: dict, target: PretrainedConfig, check: ServingCheck) -> None:
    add = check.add
    hidden, vocab, depth = int(target.hidden_size), int(target.vocab_size), int(target.num_hidden_layers)
    if data.get("hidden_size") != hidden:
        add("hidden_size", "hidden_size", f"is {data.get('hidden_size')!r}, the target's is {hidden}; the drafter "
            "reads the target's embeddings and hidden states", "train a drafter for this target", "target")
    if data.get("vocab_size") != vocab:
        add("vocab_size", "vocab_size", f"is {data.get('vocab_size')!r}, the target's is {vocab}; the drafter uses "
            f"the target's embedding and LM head ({VLLM} builds an all-zero draft-to-target token map otherwise)",
            "train a drafter for this target", "target")
    value = data.get("target_hidden_size")
    if value is not None and value != hidden:
        add("target_hidden_size", "target_hidden_size", f"is {value!r}, the target's is {hidden}; {VLLM} sizes fc "
            "by it", "remove target_hidden_size")
    value = data.get("draft_vocab_size")
    if value is not None and value != vocab:
        add("draft_vocab_size", "draft_vocab_size", f"is {value!r}, the target's is {vocab}; {VLLM} builds a draft "
            "LM head of that many rows, mapped to target ids by a 'd2t' tensor (all zeros without one); draftline's "
            "drafter predicts over the target's whole vocabulary", "remove draft_vocab_size")
    trained_depth = data.get("num_target_layers")
    if trained_depth is not None and trained_depth != depth:
        add("num_target_layers", "num_target_layers", f"is {trained_depth!r}: the drafter was trained for a target "
            f"of {trained_depth} layers, this one has {depth} ({SGLANG} only warns and goes on)",
            "use the drafter with the target it was trained for", "target")
    mask = dflash_section(data).get("mask_token_id")
    if isinstance(mask, int) and mask >= vocab:
        add("mask_token_id.range", "dflash_config.mask_token_id", f"is {mask}, outside the target's vocabulary "
            f"[0, {vocab}) ({SGLANG} refuses it at start)", "pick a row of the target's embedding, e.g. a reserved "
            "token", "target")

    ids = dflash_section(data).get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        add("target_layer_ids", "dflash_config.target_layer_ids", f"is {ids!r}; it must be a non-empty list of "
            "integers", "set the target layers the drafter was trained on")
        return
    outside = [i for i in ids if not 0 <= i < depth]
    if outside:
        add("target_layer_ids.range", "dflash_config.target_layer_ids", f"{ids} has {outside} outside the target's "
            f"{depth} layers", "use the drafter with the target it was trained for", "target")
        return
    if any(b <= a for a, b in zip(ids, ids[1:])):
        add("target_layer_ids.order", "dflash_config.target_layer_ids", f"{ids} is not strictly increasing; both "
            "engines capture the target's layers in layer order, so fc would read the features in another order "
            "than it was trained with", "train with increasing, distinct target_layer_ids")
    if depth - 1 in ids:
        add("target_layer_ids.last_layer", "dflash_config.target_layer_ids", f"{ids} holds {depth - 1}, the target's "
            "last layer. draftline and the official code read it after the target's final norm (HF "
            f"hidden_states[L]); {VLLM} captures it before that norm; {SGLANG} captures the input of layer id + 1, "
            f"which does not exist for the last layer; the {SPECULATORS} converter drops the id",
            f"train with target_layer_ids below {depth - 1} (the default rule's deepest is L-3)")
    aux = data.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [i + 1 for i in ids]:
        add("eagle_aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids", f"is {aux!r}; {VLLM} captures "
            f"these layers instead of target_layer_ids + 1 = {[i + 1 for i in ids]}",
            "remove eagle_aux_hidden_state_layer_ids")


def check_layers(data: dict, parsed, target: PretrainedConfig, check: ServingCheck) -> None:
    add = check.add
    num_layers = data.get("num_hidden_layers")
    types, window = ((parsed.layer_types, parsed.sliding_window) if parsed is not None
                     else (data.get("layer_types"), data.get("sliding_window")))
    if not isinstance(types, list) or len(types) != num_layers:
        add("layer_types", "layer_types", f"is {types!r} for num_hidden_layers={num_layers!r}",
            "list one of 'full_attention' / 'sliding_attention' per layer")
        return
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        add("layer_types.unknown", "layer_types", f"has {unknown}; the engines know 'full_attention' (non-causal in "
            "the block) and 'sliding_attention' (causal in the block)", "use only those two")
        return
    num_sliding = types.count("sliding_attention")
    raw_window = data.get("sliding_window")
    if num_sliding and not (isinstance(window, int) and window >= 1):
        if isinstance(raw_window, int) and raw_window >= 1:
            add("use_sliding_window", "use_sliding_window", f"is {data.get('use_sliding_window')!r}; transformers' "
                f"Qwen3 config, which the engines parse config.json with, drops sliding_window={raw_window} unless "
                f"it is true, and then {SGLANG} and {VLLM} refuse the sliding layers", 'set "use_sliding_window": true')
        else:
            add("sliding_window", "sliding_window", f"is {raw_window!r}; sliding_attention layers need a positive "
                f"top-level window ({SGLANG} and {VLLM} refuse to start without it)",
                'set "sliding_window" to the window the drafter was trained with and "use_sliding_window": true')
    if 0 < num_sliding < len(types):
        check.warn("mixed_layers", MIXED_LAYERS_WARNING)
    own, targets = data.get("max_position_embeddings"), getattr(target, "max_position_embeddings", None)
    if targets is not None and isinstance(own, int) and own < targets:
        check.warn("max_position_embeddings", f"max_position_embeddings is {own!r}, the target's is {targets}: "
                   f"{SGLANG} sizes the drafter's rotary table by the drafter's value ({VLLM} raises it to the "
                   "target's max_model_len for static RoPE types)")


def _check_tokenizer(data: dict, target_dir: Path, check: ServingCheck) -> None:
    """SGLang looks the mask token's string up in the target's tokenizer and refuses a different id."""
    mask = dflash_section(data).get("mask_token_id")
    if not isinstance(mask, int):
        return
    found = _first_set(data, "mask_token", ("dflash_config", ""))  # SGLang's order, then its default
    if found is not None and isinstance(found[1], str) and found[1]:
        name, source = found[1], found[0]
    else:
        name, source = SGLANG_DEFAULT_MASK_TOKEN, "SGLang's default mask token"
    token_id = tokenizer_id(target_dir, name)
    if token_id is not None and token_id != mask:
        check.add("tokenizer_mask_token", "dflash_config.mask_token_id", f"is {mask}, but the target's tokenizer has "
                  f"{name!r} ({source}) at {token_id}; {SGLANG} refuses the conflict at start",
                  f"train with mask_token_id {token_id}, or set dflash_config.mask_token to the string of row {mask}")


def tokenizer_id(target_dir: Path, token: str) -> int | None:
    """``token``'s id in the target's tokenizer.json (None: no such file or token)."""
    tokenizer_file = target_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)
