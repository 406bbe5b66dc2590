"""Would vLLM and SGLang load this drafter as it was trained? Checked on the directory, against the target.

Both engines load a DFlash drafter leniently: SGLang skips a tensor it has no place for, vLLM reports
no tensor missing, and several config fields switch either engine to another kind of drafter. A
drafter that passes here has, for the engine versions read (``ENGINES_READ``):

- exactly the tensors the engines map (per layer: input/post-attention norms, q/k/v/o projections,
  q/k norms, gate/up/down projections; then ``fc``, ``hidden_norm``, ``norm``), each with its shape,
  no ``model.`` prefix, no embedding or LM head, nothing else, and no other weight file beside it;
- a config the engines read as draftline trains it: its architecture, every layer's attention type
  and window, no field that turns on another attention, rotary style, norm or feature path;
- the target's hidden size, vocabulary and depth, feature layers in increasing order that the engines
  capture as draftline does, and a mask token inside the target's vocabulary (and, when the target
  has a tokenizer, not in conflict with the tokenizer's own mask token, which SGLang refuses).

Each finding names the field, tensor or file and the fix. Findings come in two kinds: ``target``
(the drafter is not for this target: nothing can use it with it) and ``serving`` (an engine would
run something other than what was trained). Warnings are legal drafters that need a serving flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME, read_drafter_config, read_drafter_config_json
from draftline.errors import DraftlineError
from draftline.model.config import text_config
from draftline.model.dspark import is_dspark_config

# The engine code these rules were read from (their DFlash loaders, config parsing and weight loading).
ENGINES_READ = {"vLLM": "0.33.0", "SGLang": "0.5.23"}
VLLM = f"vLLM {ENGINES_READ['vLLM']}"
SGLANG = f"SGLang {ENGINES_READ['SGLang']}"

# The warning for a drafter whose layers mix sliding-window and full attention.
MIXED_LAYERS_WARNING = (f"layer_types mixes sliding_attention and full_attention: {VLLM} runs such a drafter only on "
                        "its V2 model runner (its default; it refuses the drafter on V1): serve with "
                        "VLLM_USE_V2_MODEL_RUNNER=1")

# SGLang's default mask token string, looked up in the target's tokenizer (dflash_config.mask_token).
SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"

# Config fields that make an engine build a drafter other than the one draftline trains, with the
# value draftline trains with (None: the field must be absent) and who reads it.
_SWITCHES: tuple[tuple[str, Any, str], ...] = (
    ("is_causal", None, f"{VLLM} and {SGLANG} make every layer causal or non-causal by it"),
    ("dflash_config.causal", None, f"{VLLM} sets every layer's causality by it"),
    ("dflash_config.use_swa", False, f"{VLLM} turns every layer into sliding-window attention"),
    ("use_aux_hidden_state", True, f"{VLLM} drops fc and the target features when it is false"),
    ("dflash_config.use_aux_hidden_state", True, f"{VLLM} drops fc and the target features when it is false"),
    ("is_neox_style", True, f"{VLLM} and {SGLANG} rotate interleaved pairs when it is false; draftline rotates halves"),
    ("rope_is_neox_style", True, f"{SGLANG} rotates interleaved pairs when it is false; draftline rotates halves"),
    ("use_gemma_norm", False, f"{SGLANG} builds Gemma-style (1 + w) norms"),
    ("attention_bias", False, "draftline's projections have no bias; the engines would build biases no tensor fills"),
    ("hidden_act", "silu", "draftline's MLP is SiLU-gated; the engines build the MLP with this activation"),
    ("add_swa_attention_sink_bias", False, f"{VLLM} adds per-head attention sinks"),
    ("dflash_config.attention_sink_bias", False, f"{VLLM} and {SGLANG} add per-head attention sinks"),
    ("dflash_config.attention_value_scale", None, f"{SGLANG} scales the attention values"),
    ("dflash_config.conv_kernel_size", 0, f"{SGLANG} adds grouped convolutions around attention and MLP"),
    ("dflash_config.selector_rank", 0, f"{SGLANG} adds a candidate selector"),
    ("dflash_config.projector_type", None, f"{SGLANG} builds another projector (e.g. 'domino')"),
)


@dataclass(frozen=True)
class Finding:
    subject: str
    """The field, tensor or file at fault."""
    problem: str
    fix: str
    kind: str = "serving"
    """'target': the drafter does not fit this target; 'serving': an engine would load it differently."""

    def __str__(self) -> str:
        return f"{self.subject}: {self.problem}. Fix: {self.fix}"


@dataclass
class ServingCheck:
    """What ``inspect_drafter_dir`` found; ``raise_if_refused`` turns findings into one error."""

    path: Path
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    """The directory's config.json as read."""
    config: PretrainedConfig | None = None
    """The drafter config it describes (None where it builds none)."""
    config_error: str = ""
    """Why ``config`` is None."""

    def refused(self, kinds: tuple[str, ...] = ("target", "serving")) -> list[Finding]:
        return [f for f in self.findings if f.kind in kinds]

    def raise_if_refused(self, kinds: tuple[str, ...] = ("target", "serving")) -> None:
        refused = self.refused(kinds)
        if refused:
            engines = " and ".join(f"{name} {version}" for name, version in ENGINES_READ.items())
            raise DraftlineError(
                f"{self.path}: {engines} would not load this drafter as it was trained "
                f"({len(refused)} problem{'s' if len(refused) > 1 else ''}):\n"
                + "\n".join(f"  - {f}" for f in refused)
            )


def check_drafter_dir(path: str | Path, target: str | Path | PretrainedConfig,
                      target_config: PretrainedConfig | None = None) -> list[str]:
    """Raise DraftlineError naming every problem an engine would trip on; return the warnings.

    ``target`` is the target's model directory (its tokenizer is checked too) or its config;
    ``target_config``: the directory's config already read (it is not read again).
    """
    check = inspect_drafter_dir(path, target, target_config)
    check.raise_if_refused()
    return check.warnings


def released_drafter_config(path: str | Path, target_dir: str | Path) -> tuple[PretrainedConfig, list[str]]:
    """A released drafter's config, for a start from it (``--init-drafter``), and the warnings of its check:
    ``check_drafter_dir``'s refusals raised, its config.json read once for both."""
    from draftline.model.target import load_target_config

    check = _inspect(Path(path), Path(target_dir), text_config(load_target_config(target_dir)))
    check.raise_if_refused()
    if check.config is None:
        raise DraftlineError(f"{Path(path) / CONFIG_NAME}: builds no drafter config ({check.config_error})")
    return check.config, check.warnings


def inspect_drafter_dir(path: str | Path, target: str | Path | PretrainedConfig,
                        target_config: PretrainedConfig | None = None) -> ServingCheck:
    target_dir = None if isinstance(target, PretrainedConfig) else Path(target)
    if target_config is not None:
        target = target_config
    elif target_dir is not None:
        from draftline.model.target import load_target_config

        target = load_target_config(target_dir)
    return _inspect(Path(path), target_dir, text_config(target))


def _inspect(path: Path, target_dir: Path | None, target: PretrainedConfig) -> ServingCheck:
    """Every check of the drafter in ``path`` against the target's text config ``target`` (and its
    tokenizer, with ``target_dir``)."""
    if is_dspark_config(read_drafter_config_json(path)):  # DSpark's rules: checkpoint.dspark_serving
        from draftline.checkpoint.dspark_serving import inspect_dspark_dir

        return inspect_dspark_dir(path, target_dir, target)
    data, config, config_error = read_drafter_config(path)
    check = ServingCheck(path, data=data, config=config, config_error=config_error)
    _check_format(data, check)
    _check_switches(data, check)
    _check_against_target(data, target, check)
    _check_layers(data, target, check)
    if target_dir is not None:
        _check_tokenizer(data, target_dir, check)
    _check_files(path, check)
    if (path / WEIGHTS_NAME).is_file():
        _check_tensors(path, data, check)
    return check


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def _get(data: dict, dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _dflash(data: dict) -> dict:
    value = data.get("dflash_config")
    return value if isinstance(value, dict) else {}


def _check_format(data: dict, check: ServingCheck) -> None:
    add = check.findings.append
    if data.get("architectures") != ["DFlashDraftModel"]:
        add(Finding("architectures", f"is {data.get('architectures')!r}; both engines pick their DFlash model "
                    "class by it (vLLM's registry, SGLang's model classes), and other names build other drafters",
                    'set "architectures": ["DFlashDraftModel"]'))
    if data.get("model_type") != "qwen3":
        add(Finding("model_type", f"is {data.get('model_type')!r}; the engines parse config.json with the "
                    "config class of this type, and draftline trains a Qwen3-layer drafter",
                    'set "model_type": "qwen3"'))
    if not isinstance(data.get("dflash_config"), dict):
        add(Finding("dflash_config", "missing; it holds mask_token_id and target_layer_ids",
                    "export the drafter with draftline export"))
    block_size = data.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        add(Finding("block_size", f"is {block_size!r}; it must be an integer >= 2 (one anchor plus draft slots)",
                    "set the block size the drafter was trained with"))
    dflash = _dflash(data)
    for name in ("block_size", "num_target_layers"):
        if name in dflash and dflash[name] != data.get(name):
            add(Finding(f"dflash_config.{name}", f"is {dflash[name]!r} but the top-level {name} is "
                        f"{data.get(name)!r}; {SGLANG} reads dflash_config's, draftline and the official code the "
                        "top-level one", f"remove dflash_config.{name}"))
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        add(Finding("dflash_config.mask_token_id", f"is {mask!r}; without an integer id {SGLANG} resolves the "
                    "mask token from the tokenizer instead of the row the drafter was trained with",
                    "set the embedding row the drafter was trained with"))


def _check_switches(data: dict, check: ServingCheck) -> None:
    for name, trained, reader in _SWITCHES:
        value = _get(data, name)
        if value is None or value == trained or (trained in (False, 0) and not value):
            continue
        fix = f'set it to {json.dumps(trained)} or remove it' if trained not in (None, False, 0) else f"remove {name}"
        check.findings.append(Finding(name, f"is {value!r}: {reader}", fix))
    window = _dflash(data).get("swa_window_size")
    if window is not None and window != data.get("sliding_window"):
        check.findings.append(Finding(
            "dflash_config.swa_window_size", f"is {window!r} but sliding_window is {data.get('sliding_window')!r}; "
            f"{VLLM} takes the window from swa_window_size, {SGLANG} and draftline from sliding_window",
            "remove dflash_config.swa_window_size"))


def _check_against_target(data: dict, target: PretrainedConfig, check: ServingCheck) -> None:
    add = check.findings.append
    hidden, vocab, depth = int(target.hidden_size), int(target.vocab_size), int(target.num_hidden_layers)
    if data.get("hidden_size") != hidden:
        add(Finding("hidden_size", f"is {data.get('hidden_size')!r}, the target's is {hidden}; the drafter reads "
                    "the target's embeddings and hidden states", "train a drafter for this target", "target"))
    if data.get("vocab_size") != vocab:
        add(Finding("vocab_size", f"is {data.get('vocab_size')!r}, the target's is {vocab}; the drafter uses the "
                    f"target's embedding and LM head ({VLLM} builds an all-zero draft-to-target token map otherwise)",
                    "train a drafter for this target", "target"))
    for name, expected in (("target_hidden_size", hidden), ("draft_vocab_size", vocab)):
        value = data.get(name)
        if value is not None and value != expected:
            add(Finding(name, f"is {value!r}, the target's is {expected}; {VLLM} sizes the drafter by it",
                        f"remove {name}"))
    trained_depth = data.get("num_target_layers")
    if trained_depth is not None and trained_depth != depth:
        add(Finding("num_target_layers", f"is {trained_depth!r}: the drafter was trained for a target of "
                    f"{trained_depth} layers, this one has {depth} ({SGLANG} only warns and goes on)",
                    "use the drafter with the target it was trained for", "target"))
    mask = _dflash(data).get("mask_token_id")
    if isinstance(mask, int) and mask >= vocab:
        add(Finding("dflash_config.mask_token_id", f"is {mask}, outside the target's vocabulary [0, {vocab}) "
                    f"({SGLANG} refuses it at start)", "pick a row of the target's embedding, e.g. a reserved token",
                    "target"))

    ids = _dflash(data).get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        add(Finding("dflash_config.target_layer_ids", f"is {ids!r}; it must be a non-empty list of integers",
                    "set the target layers the drafter was trained on"))
        return
    outside = [i for i in ids if not 0 <= i < depth]
    if outside:
        add(Finding("dflash_config.target_layer_ids", f"{ids} has {outside} outside the target's {depth} layers",
                    "use the drafter with the target it was trained for", "target"))
        return
    if any(b <= a for a, b in zip(ids, ids[1:])):
        add(Finding("dflash_config.target_layer_ids", f"{ids} is not strictly increasing; both engines capture the "
                    "target's layers in layer order, so fc would read the features in another order than it was "
                    "trained with", "train with increasing, distinct target_layer_ids"))
    if depth - 1 in ids:
        add(Finding("dflash_config.target_layer_ids", f"{ids} holds {depth - 1}, the target's last layer. draftline "
                    "and the official code read it after the target's final norm (HF hidden_states[L]); "
                    f"{VLLM} captures it before that norm; {SGLANG} captures the input of layer id + 1, which does not "
                    "exist for the last layer; the speculators converter drops the id",
                    f"train with target_layer_ids below {depth - 1} (the default rule's deepest is L-3)"))
    aux = data.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != [i + 1 for i in ids]:
        add(Finding("eagle_aux_hidden_state_layer_ids", f"is {aux!r}; {VLLM} captures these layers instead of "
                    f"target_layer_ids + 1 = {[i + 1 for i in ids]}", "remove eagle_aux_hidden_state_layer_ids"))


def _parsed_layers(data: dict) -> tuple[list | None, Any]:
    """``(layer_types, sliding_window)`` as transformers' Qwen3 config reads them: both engines parse
    config.json with it (it derives layer_types when absent and drops sliding_window unless
    use_sliding_window is true); draftline does too."""
    from transformers import Qwen3Config

    fields = {k: v for k, v in data.items() if k not in ("block_size", "num_target_layers", "dflash_config")}
    try:
        config = Qwen3Config.from_dict(fields)
    except Exception:  # noqa: BLE001 - its validators raise their own error types; the raw fields are then checked
        return data.get("layer_types"), data.get("sliding_window")
    return config.layer_types, config.sliding_window


def _check_layers(data: dict, target: PretrainedConfig, check: ServingCheck) -> None:
    add = check.findings.append
    num_layers = data.get("num_hidden_layers")
    types, window = _parsed_layers(data)
    if not isinstance(types, list) or len(types) != num_layers:
        add(Finding("layer_types", f"is {types!r} for num_hidden_layers={num_layers!r}",
                    "list one of 'full_attention' / 'sliding_attention' per layer"))
        return
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        add(Finding("layer_types", f"has {unknown}; the engines know 'full_attention' (non-causal in the block) "
                    "and 'sliding_attention' (causal in the block)", "use only those two"))
        return
    num_sliding = types.count("sliding_attention")
    raw_window = data.get("sliding_window")
    if num_sliding and not (isinstance(window, int) and window >= 1):
        if isinstance(raw_window, int) and raw_window >= 1:
            add(Finding("use_sliding_window", f"is {data.get('use_sliding_window')!r}; transformers' Qwen3 config, "
                        f"which the engines parse config.json with, drops sliding_window={raw_window} unless it is "
                        f"true, and then {SGLANG} and {VLLM} refuse the sliding layers", 'set "use_sliding_window": true'))
        else:
            add(Finding("sliding_window", f"is {raw_window!r}; sliding_attention layers need a positive top-level "
                        f"window ({SGLANG} and {VLLM} refuse to start without it)",
                        'set "sliding_window" to the window the drafter was trained with and "use_sliding_window": true'))
    if 0 < num_sliding < len(types):
        check.warnings.append(MIXED_LAYERS_WARNING)
    own, targets = data.get("max_position_embeddings"), getattr(target, "max_position_embeddings", None)
    if targets is not None and own != targets:
        check.warnings.append(
            f"max_position_embeddings is {own!r}, the target's is {targets}: both engines size the drafter's rotary "
            "table by the drafter's value")


def _check_tokenizer(data: dict, target_dir: Path, check: ServingCheck) -> None:
    """SGLang looks the mask token's string up in the target's tokenizer and refuses a different id."""
    tokenizer_file = target_dir / "tokenizer.json"
    mask = _dflash(data).get("mask_token_id")
    if not tokenizer_file.is_file() or not isinstance(mask, int):
        return
    from tokenizers import Tokenizer

    name = _dflash(data).get("mask_token") or SGLANG_DEFAULT_MASK_TOKEN
    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(name)
    if token_id is not None and token_id != mask:
        check.findings.append(Finding(
            "dflash_config.mask_token_id", f"is {mask}, but the target's tokenizer has {name!r} at {token_id}; "
            f"{SGLANG} refuses the conflict at start",
            f"train with mask_token_id {token_id}, or set dflash_config.mask_token to the string of row {mask}"))


def _check_files(path: Path, check: ServingCheck) -> None:
    if not (path / WEIGHTS_NAME).is_file():
        check.findings.append(Finding(WEIGHTS_NAME, "missing", "export the drafter with draftline export"))
    for other in sorted(path.iterdir()):
        if other.name == WEIGHTS_NAME:
            continue
        if other.suffix == ".safetensors" or other.name.endswith(".safetensors.index.json"):
            check.findings.append(Finding(other.name, f"{VLLM} loads every *.safetensors file in the drafter's "
                                          "directory (and an index names the shards)", f"remove {other.name}"))
        elif other.name == "mask_embedding.pt":
            check.findings.append(Finding(other.name, f"{VLLM} and {SGLANG} put it in place of the mask token's "
                                          "embedding row, which draftline trains with", f"remove {other.name}"))


# ---------------------------------------------------------------------------------------------
# model.safetensors
# ---------------------------------------------------------------------------------------------


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """Every tensor the engines map for ``config``, with its shape (the drafter's state dict)."""
    import torch

    from draftline.model.drafter import DFlashDrafter

    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def _sizes_config(data: dict):
    """The drafter's sizes from config.json; attention types and windows are left out (they name no
    tensor), so the tensors are checked even when those fields are refused."""
    from transformers import Qwen3Config

    skip = ("block_size", "num_target_layers", "dflash_config", "layer_types", "sliding_window", "use_sliding_window")
    config = Qwen3Config.from_dict({k: v for k, v in data.items() if k not in skip})
    ids = _dflash(data).get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("no target_layer_ids: fc's width is unknown")
    config.block_size = 2
    config.dflash_config = _dflash(data)
    return config


def _check_tensors(path: Path, data: dict, check: ServingCheck) -> None:
    from safetensors import safe_open

    add = check.findings.append
    try:
        config = _sizes_config(data)
        expected = expected_tensors(config)
    except Exception:  # noqa: BLE001 - sizes that build no drafter; the findings on config.json name them
        if not check.findings:
            add(Finding(CONFIG_NAME, "its sizes build no drafter", "export the drafter with draftline export"))
        return
    with safe_open(path / WEIGHTS_NAME, framework="pt", device="cpu") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    prefixed = sorted(n for n in shapes if n.startswith("model."))
    if prefixed:
        add(Finding(prefixed[0] + (f" (and {len(prefixed) - 1} more)" if len(prefixed) > 1 else ""),
                    f"has a 'model.' prefix; {VLLM} prepends 'model.' itself and refuses the doubled name, "
                    f"{SGLANG} strips it", "save the tensors without the prefix"))
    names = {n.removeprefix("model.") for n in shapes}
    shared = sorted(n for n in names if n.split(".")[0] in ("embed_tokens", "lm_head"))
    for name in shared:
        add(Finding(name, f"a drafter borrows the target's embedding and LM head: with this tensor present {VLLM} "
                    f"uses the drafter's copy where it differs from the target's, {SGLANG} and the speculators "
                    "converter the target's",
                    f"remove {name}"))
    unknown = sorted(names - set(expected) - set(shared))
    if unknown:
        add(Finding(", ".join(unknown[:6]) + (" ..." if len(unknown) > 6 else ""),
                    f"{len(unknown)} tensor{'s' if len(unknown) > 1 else ''} no engine maps ({SGLANG} skips unknown "
                    f"tensors without a word; {VLLM} refuses them at start, except '*.bias' names, which it skips)", "remove them, or rename them to the names "
                    "of the drafter's modules"))
    missing = sorted(set(expected) - names)
    if missing:
        add(Finding(", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""),
                    f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} the engines map "
                    f"{'is' if len(missing) == 1 else 'are'} missing (neither {VLLM} nor {SGLANG} reports a missing "
                    "tensor: the parameter keeps whatever memory it was given)",
                    f"save every tensor of the {config.num_hidden_layers}-layer drafter"))
    for name in sorted(set(expected) & names):
        shape = shapes.get(name, shapes.get("model." + name))
        if shape != expected[name]:
            add(Finding(name, f"has shape {shape}, the config needs {expected[name]}",
                        "save the tensor the config describes (or fix the config's sizes)"))
