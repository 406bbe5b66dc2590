"""The rules on a DSpark drafter: SGLang's and vLLM's DSpark loaders, on their DFlash backbone.

Both engines build DSpark on their DFlash backbone (SGLang ``models/dspark.py`` over ``models/dflash.py``; vLLM
``qwen3_dspark.py`` over ``qwen3_dflash.py``), so the backbone's rules are the DFlash drafter's
(``config_rules``, ``file_rules``), read on the top-level ``mask_token_id`` and ``target_layer_ids`` (their
findings name those fields). DSpark's own rules (ids ``dspark.*`` in ``findings.RULES``), for the engine versions
read (``findings.ENGINES_READ``):

- ``architectures`` ``["Qwen3DSparkModel"]`` (vLLM picks method and model by it, SGLang its model class),
  ``model_type`` qwen3, an integer ``block_size`` (the drafted tokens) and ``mask_token_id`` at the top level,
  no ``dflash_config`` (both engines read its mask token and layer ids before the top-level ones);
- ``markov_rank`` > 0 (SGLang refuses 0), ``markov_head_type`` vanilla or gated (what draftline trains);
  a gated head is refused for vLLM only (kind ``vllm``): vLLM builds the vanilla head whatever the field says
  and refuses ``gate_proj``'s tensors; SGLang serves it;
- the confidence head's flags as booleans, ``confidence_head_with_markov`` written out (SGLang defaults it to
  true, vLLM to false), and a warning when the head is off (SGLang builds one anyway and, in its
  ``SGLANG_RAGGED_VERIFY_MODE`` cap-accept and compact modes, refuses a checkpoint without its tensors);
- none of the fields that select another drafting convention: ``speculators_model_type`` "dspark" (SGLang
  refuses it: slot j predicts anchor + j there), ``sample_from_anchor`` false (vLLM then drafts B + 1 slots,
  the anchor's slot as a bonus);
- exactly the tensors of the backbone and the heads, each with its shape: ``markov_head.markov_w1.weight``
  [V, r], ``markov_head.markov_w2.weight`` [V, r] (+ ``markov_head.gate_proj.{weight,bias}``),
  ``confidence_head.proj.{weight,bias}`` [1, H (+ r)], [1] (SGLang refuses unknown Markov tensors and, with
  the head on, missing confidence ones; vLLM refuses unknown tensors and drops the confidence head when its
  tensors are absent).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import PretrainedConfig

from draftline.checkpoint.serving import config_rules, file_rules
from draftline.checkpoint.serving.findings import SGLANG, VLLM, ServingCheck
from draftline.model.dspark import DSPARK_ARCHITECTURE, MARKOV_HEAD_TYPES

VLLM_GATED_WARNING = (f"markov_head_type is gated: {VLLM} does not serve this drafter (its DSpark model builds the "
                      f"vanilla Markov head only and refuses the gate's tensors); {SGLANG} serves it")
CONFIDENCE_OFF_WARNING = (f"enable_confidence_head is false: {SGLANG} builds a confidence head anyway and, with "
                          "SGLANG_RAGGED_VERIFY_MODE cap-accept or compact, refuses a checkpoint without its tensors; "
                          "its default (static) mode and vLLM serve the drafter without one")


def check_dspark_config(data: dict, target: PretrainedConfig, check: ServingCheck) -> None:
    """The config rules: the backbone's, on the top-level fields, then DSpark's own."""
    view = backbone_view(data)
    backbone = ServingCheck(check.path)
    config_rules.check_switches(view, backbone)
    config_rules.check_against_target(view, target, backbone)
    config_rules.check_layers(view, config_rules.parsed(view), target, backbone)
    _moved(backbone, check)
    _check_format(data, check)
    _check_heads(data, check)


def check_dspark_files(path: Path, data: dict, check: ServingCheck) -> None:
    """The file rules of the backbone, with the heads' tensors among those the engines map."""
    file_rules.check_files(path, backbone_view(data), check, extra_tensors=head_tensors(data))


def backbone_view(data: dict) -> dict:
    """``data`` as the DFlash backbone's rules read it: the top-level mask token and layer ids in a dflash_config."""
    moved = {k: data[k] for k in ("mask_token_id", "target_layer_ids") if k in data}
    return {**{k: v for k, v in data.items() if k != "dflash_config"}, "dflash_config": moved}


def _moved(backbone: ServingCheck, check: ServingCheck) -> None:
    """The backbone's findings and warnings into ``check``, naming the top-level fields DSpark keeps them in."""
    def top(text: str) -> str:
        return text.replace("dflash_config.", "")

    check.findings.extend(dataclasses.replace(f, subject=top(f.subject), problem=top(f.problem), fix=top(f.fix))
                          for f in backbone.findings)
    for rule, warning in zip(backbone.warned, backbone.warnings):
        check.warn(rule, warning)


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_format(data: dict, check: ServingCheck) -> None:
    add = check.add
    if data.get("architectures") != [DSPARK_ARCHITECTURE]:
        add("dspark.architectures", "architectures", f"is {data.get('architectures')!r}; {VLLM} picks the dspark "
            f"method and model by it, {SGLANG} its DSpark model class", f'set "architectures": ["{DSPARK_ARCHITECTURE}"]')
    if data.get("model_type") != "qwen3":
        add("model_type", "model_type", f"is {data.get('model_type')!r}; the engines parse config.json with the "
            "config class of this type, and draftline trains a Qwen3-layer drafter", 'set "model_type": "qwen3"')
    if not _is_int(data.get("block_size"), 1):
        add("dspark.block_size", "block_size", f"is {data.get('block_size')!r}; it must be the drafted tokens per "
            "block, an integer >= 1", "set the block size the drafter was trained with")
    if not _is_int(data.get("mask_token_id"), 0):
        add("dspark.mask_token_id", "mask_token_id", f"is {data.get('mask_token_id')!r}; {SGLANG} refuses a DSpark "
            "drafter without an integer mask token id at the top level", "set the embedding row the drafter was "
            "trained with")
    if "dflash_config" in data:
        add("dspark.dflash_config", "dflash_config", "is present; both engines read its mask_token_id and "
            "target_layer_ids before the top-level ones, and a DSpark drafter keeps them at the top level",
            "remove dflash_config")
    if data.get("speculators_model_type") is not None:
        add("dspark.speculators_model_type", "speculators_model_type", f"is {data['speculators_model_type']!r}; "
            f"{SGLANG} refuses the speculators convention (slot j predicts anchor + j), draftline trains slot k on "
            "anchor + k + 1", "remove speculators_model_type")
    if data.get("sample_from_anchor", True) is not True:
        add("dspark.sample_from_anchor", "sample_from_anchor", f"is {data['sample_from_anchor']!r}; {VLLM} then "
            "drafts from the slots after the anchor's, one position late for a drafter whose anchor slot drafts",
            "remove sample_from_anchor")


def _check_heads(data: dict, check: ServingCheck) -> None:
    add = check.add
    if not _is_int(data.get("markov_rank"), 1):
        add("dspark.markov_rank", "markov_rank", f"is {data.get('markov_rank')!r}; {SGLANG} refuses a DSpark drafter "
            "without a positive Markov rank, and the Markov head's tensors have this width", "set the trained rank")
    kind = data.get("markov_head_type")
    if kind not in MARKOV_HEAD_TYPES:
        add("dspark.markov_head_type", "markov_head_type", f"is {kind!r}; draftline trains "
            f"{' or '.join(MARKOV_HEAD_TYPES)} heads and the engines build the head this field names",
            "set the trained head type")
    elif kind == "gated":
        add("dspark.markov_head_type.vllm", "markov_head_type", f"is gated; {VLLM}'s DSpark model builds the vanilla "
            "head only and refuses the gate's tensors at load", "serve with SGLang, or train with --markov-head-type "
            "vanilla", "vllm")
        check.warn("dspark.markov_head_type.vllm", VLLM_GATED_WARNING)
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if name in data and not isinstance(data[name], bool):
            add("dspark.confidence_flags", name, f"is {data[name]!r}; it must be true or false", "set the trained value")
    if data.get("enable_confidence_head") is True and "confidence_head_with_markov" not in data:
        add("dspark.confidence_head_with_markov", "confidence_head_with_markov", f"missing: {SGLANG} then reads the "
            f"confidence head with the Markov input, {VLLM} without it", "set the trained value")
    if data.get("enable_confidence_head") is False:
        check.warn("dspark.confidence_head_off", CONFIDENCE_OFF_WARNING)


def head_tensors(data: dict) -> dict[str, tuple[int, ...]]:
    """The heads' tensors the engines map for the config.json ``data``, with their shapes."""
    vocab, hidden, rank = data.get("vocab_size"), data.get("hidden_size"), data.get("markov_rank")
    if not (_is_int(vocab, 1) and _is_int(hidden, 1) and _is_int(rank, 1)):
        return {}
    shapes = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if data.get("markov_head_type") == "gated":
        shapes.update({"markov_head.gate_proj.weight": (rank, hidden + rank), "markov_head.gate_proj.bias": (rank,)})
    if data.get("enable_confidence_head") is True:
        width = hidden + (rank if data.get("confidence_head_with_markov") is True else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes
