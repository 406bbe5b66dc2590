"""Would SGLang's and vLLM's DSpark loaders load this DSpark drafter as it was trained?

Both engines build DSpark on their DFlash backbone (SGLang ``models/dspark.py`` over ``models/dflash.py``; vLLM
``qwen3_dspark.py`` over ``qwen3_dflash.py``), so the backbone's rules are ``checkpoint.serving``'s, read on the
top-level ``mask_token_id`` and ``target_layer_ids`` (findings name those fields). DSpark's own rules, for the
engine versions read (``serving.ENGINES_READ``):

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

from pathlib import Path

from transformers import PretrainedConfig

from draftline.checkpoint import serving
from draftline.checkpoint.export import WEIGHTS_NAME, read_drafter_config
from draftline.checkpoint.serving import SGLANG, VLLM, Finding, ServingCheck
from draftline.model.dspark import DSPARK_ARCHITECTURE, MARKOV_HEAD_TYPES

VLLM_GATED_WARNING = (f"markov_head_type is gated: {VLLM} does not serve this drafter (its DSpark model builds the "
                      f"vanilla Markov head only and refuses the gate's tensors); {SGLANG} serves it")
CONFIDENCE_OFF_WARNING = (f"enable_confidence_head is false: {SGLANG} builds a confidence head anyway and, with "
                          "SGLANG_RAGGED_VERIFY_MODE cap-accept or compact, refuses a checkpoint without its tensors; "
                          "its default (static) mode and vLLM serve the drafter without one")


def inspect_dspark_dir(path: Path, target_dir: Path | None, target: PretrainedConfig) -> ServingCheck:
    """Every check of the DSpark drafter in ``path`` against the target's text config ``target``."""
    data, config, config_error = read_drafter_config(path)
    check = ServingCheck(path, data=data, config=config, config_error=config_error)
    view = _backbone_view(data)
    shared = ServingCheck(path)
    serving._check_switches(view, shared)
    serving._check_against_target(view, target, shared)
    serving._check_layers(view, target, shared)
    serving._check_files(path, shared)
    for finding in shared.findings:
        top = lambda text: text.replace("dflash_config.", "")  # noqa: E731 - the fields sit at the top level here
        check.findings.append(Finding(top(finding.subject), finding.problem, top(finding.fix), finding.kind))
    check.warnings.extend(shared.warnings)
    _check_format(data, check)
    _check_heads(data, check)
    if (path / WEIGHTS_NAME).is_file():
        _check_tensors(path, data, view, check)
    return check


def _backbone_view(data: dict) -> dict:
    """``data`` as the DFlash backbone rules read it: the top-level mask token and layer ids in a dflash_config."""
    moved = {k: data[k] for k in ("mask_token_id", "target_layer_ids") if k in data}
    return {**data, "dflash_config": moved}


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_format(data: dict, check: ServingCheck) -> None:
    add = check.findings.append
    if data.get("architectures") != [DSPARK_ARCHITECTURE]:
        add(Finding("architectures", f"is {data.get('architectures')!r}; {VLLM} picks the dspark method and model by "
                    f"it, {SGLANG} its DSpark model class", f'set "architectures": ["{DSPARK_ARCHITECTURE}"]'))
    if data.get("model_type") != "qwen3":
        add(Finding("model_type", f"is {data.get('model_type')!r}; the engines parse config.json with the config class "
                    "of this type, and draftline trains a Qwen3-layer drafter", 'set "model_type": "qwen3"'))
    if not _is_int(data.get("block_size"), 1):
        add(Finding("block_size", f"is {data.get('block_size')!r}; it must be the drafted tokens per block, an integer "
                    ">= 1", "set the block size the drafter was trained with"))
    if not _is_int(data.get("mask_token_id"), 0):
        add(Finding("mask_token_id", f"is {data.get('mask_token_id')!r}; {SGLANG} refuses a DSpark drafter without "
                    "an integer mask token id at the top level", "set the embedding row the drafter was trained with"))
    if "dflash_config" in data:
        add(Finding("dflash_config", "is present; both engines read its mask_token_id and target_layer_ids before the "
                    "top-level ones, and a DSpark drafter keeps them at the top level", "remove dflash_config"))
    if data.get("speculators_model_type") is not None:
        add(Finding("speculators_model_type", f"is {data['speculators_model_type']!r}; {SGLANG} refuses the "
                    "speculators convention (slot j predicts anchor + j), draftline trains slot k on anchor + k + 1",
                    "remove speculators_model_type"))
    if data.get("sample_from_anchor", True) is not True:
        add(Finding("sample_from_anchor", f"is {data['sample_from_anchor']!r}; {VLLM} then drafts from the slots "
                    "after the anchor's, one position late for a drafter whose anchor slot drafts",
                    "remove sample_from_anchor"))


def _check_heads(data: dict, check: ServingCheck) -> None:
    add = check.findings.append
    if not _is_int(data.get("markov_rank"), 1):
        add(Finding("markov_rank", f"is {data.get('markov_rank')!r}; {SGLANG} refuses a DSpark drafter without a "
                    "positive Markov rank, and the Markov head's tensors have this width", "set the trained rank"))
    kind = data.get("markov_head_type")
    if kind not in MARKOV_HEAD_TYPES:
        add(Finding("markov_head_type", f"is {kind!r}; draftline trains {' or '.join(MARKOV_HEAD_TYPES)} heads and the "
                    "engines build the head this field names", "set the trained head type"))
    elif kind == "gated":
        add(Finding("markov_head_type", f"is gated; {VLLM}'s DSpark model builds the vanilla head only and refuses "
                    "the gate's tensors at load", "serve with SGLang, or train with markov_head_type vanilla", "vllm"))
        check.warnings.append(VLLM_GATED_WARNING)
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if name in data and not isinstance(data[name], bool):
            add(Finding(name, f"is {data[name]!r}; it must be true or false", "set the trained value"))
    if data.get("enable_confidence_head") is True and "confidence_head_with_markov" not in data:
        add(Finding("confidence_head_with_markov", f"missing: {SGLANG} then reads the confidence head with the Markov "
                    f"input, {VLLM} without it", "set the trained value"))
    if data.get("enable_confidence_head") is False:
        check.warnings.append(CONFIDENCE_OFF_WARNING)


def expected_head_tensors(data: dict) -> dict[str, tuple[int, ...]]:
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


def _check_tensors(path: Path, data: dict, view: dict, check: ServingCheck) -> None:
    from safetensors import safe_open

    add = check.findings.append
    try:
        expected = {**serving.expected_tensors(serving._sizes_config(view)), **expected_head_tensors(data)}
    except Exception:  # noqa: BLE001 - sizes that build no drafter; the findings on config.json name them
        if not check.findings:
            add(Finding("config.json", "its sizes build no drafter", "export the drafter with draftline export"))
        return
    with safe_open(path / WEIGHTS_NAME, framework="pt", device="cpu") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    prefixed = sorted(n for n in shapes if n.startswith("model."))
    if prefixed:
        add(Finding(prefixed[0], f"has a 'model.' prefix ({len(prefixed)} tensors); {VLLM} prepends 'model.' itself",
                    "save the tensors without the prefix"))
    names = {n.removeprefix("model.") for n in shapes}
    shared = sorted(n for n in names if n.split(".")[0] in ("embed_tokens", "lm_head"))
    for name in shared:
        add(Finding(name, f"a drafter borrows the target's embedding and LM head; with this tensor present {VLLM} uses "
                    "the drafter's copy", f"remove {name}"))
    unknown = sorted(names - set(expected) - set(shared))
    if unknown:
        add(Finding(", ".join(unknown[:6]), f"{len(unknown)} tensor(s) no engine maps ({SGLANG} refuses unknown Markov "
                    f"tensors and skips others, {VLLM} refuses them at start)", "remove them"))
    missing = sorted(set(expected) - names)
    if missing:
        add(Finding(", ".join(missing[:6]), f"{len(missing)} tensor(s) the engines map are missing ({VLLM} drops a "
                    f"confidence head without its tensors and reports no other missing tensor; {SGLANG} refuses a "
                    "missing confidence tensor in its non-static verify modes)",
                    "save every tensor of the drafter and its heads"))
    for name in sorted(set(expected) & names):
        shape = shapes.get(name, shapes.get("model." + name))
        if shape != expected[name]:
            add(Finding(name, f"has shape {shape}, the config needs {expected[name]}",
                        "save the tensor the config describes (or fix the config's sizes)"))
