"""Would vLLM and SGLang load this drafter as it was trained? Rules applied to its files, against the target.

No engine code runs here. Each rule (``RULES``, by id) was written from a read of the engines' own
sources at the versions in ``ENGINES_READ`` (their DFlash model classes, config parsing, speculative
config and weight loading; the PyPI wheels vllm 0.33.0 and sglang 0.5.23) and, for the last-layer
rule, speculators 0.9.0's DFlash converter; each says in its message which engine does what. Another
engine version may read a field differently: the rules describe these versions only.

Both engines load a DFlash drafter leniently: SGLang skips a tensor it has no place for, neither
reports a missing one, and several config fields switch either engine to another kind of drafter. A
drafter that passes has, for those versions:

- exactly the tensors the engines map (per layer: input/post-attention norms, q/k/v/o projections,
  q/k norms, gate/up/down projections; then ``fc``, ``hidden_norm``, ``norm``), each with its shape,
  no ``model.`` prefix, no embedding, LM head or vocabulary map, nothing else, and no other weight or
  quantization file beside it;
- a config the engines read as draftline trains it: its architecture, every layer's attention type
  and window, no field that turns on another attention, rotary layout or width, norm, feature path,
  projector or quantization;
- the target's hidden size, vocabulary and depth, feature layers in increasing order that the engines
  capture as draftline does, and a mask token inside the target's vocabulary (and, when the target
  has a tokenizer, not in conflict with the token SGLang looks up there).

Each finding names the field, tensor or file, the fix and its rule. Findings come in two kinds:
``target`` (the drafter is not for this target: nothing can use it with it) and ``serving`` (an engine
would run something other than what was trained). Warnings are legal drafters that need a serving
flag or deserve a look. ``draftline train`` applies the config rules to the drafter it is about to
train (``check_drafter_config``), ``export`` all of them to what it writes.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig

from draftline.checkpoint.export import CONFIG_NAME, drafter_config_dict, read_drafter_config
from draftline.checkpoint.serving.config_rules import check_config, tokenizer_id
from draftline.checkpoint.serving.dspark_rules import check_dspark_config, check_dspark_files
from draftline.checkpoint.serving.file_rules import check_files, expected_tensors
from draftline.checkpoint.serving.findings import (
    ENGINES_READ, MIXED_LAYERS_WARNING, RULES, SGLANG, SGLANG_DEFAULT_MASK_TOKEN, SPECULATORS, VLLM, Finding,
    ServingCheck, count, engines,
)
from draftline.errors import DraftlineError
from draftline.model.config import text_config
from draftline.model.dspark import is_dspark_config

__all__ = ["ENGINES_READ", "MIXED_LAYERS_WARNING", "RULES", "SGLANG", "SGLANG_DEFAULT_MASK_TOKEN", "SPECULATORS", "VLLM",
           "Finding",
           "ServingCheck", "check_drafter_config", "check_drafter_dir", "engine_mask_token_id", "expected_tensors",
           "inspect_drafter_dir", "released_drafter_config"]

# The run's flags that set a config field, named in the train-time check's fixes.
TRAIN_FLAGS = {"dflash_config.target_layer_ids": "--target-layer-ids", "dflash_config.mask_token_id": "--mask-token-id",
               "target_layer_ids": "--target-layer-ids", "mask_token_id": "--mask-token-id",
               "block_size": "--block-size", "layer_types": "--layer-types", "sliding_window": "--sliding-window",
               "use_sliding_window": "--sliding-window", "markov_rank": "--markov-rank",
               "markov_head_type": "--markov-head-type"}


def check_drafter_dir(path: str | Path, target: str | Path | PretrainedConfig,
                      target_config: PretrainedConfig | None = None) -> list[str]:
    """Raise DraftlineError naming every problem an engine would trip on; return the warnings.

    ``target`` is the target's model directory (its tokenizer is checked too) or its config;
    ``target_config``: the directory's config already read (it is not read again).
    """
    check = inspect_drafter_dir(path, target, target_config)
    check.raise_if_refused()
    return check.warnings


def check_drafter_config(config: PretrainedConfig, target_dir: str | Path, target_config: PretrainedConfig,
                         *, refuse: bool = True) -> list[str]:
    """The config rules applied to the drafter a run is about to train, before anything is loaded: raise
    DraftlineError naming each field (and the flag that sets it) with the fix; return the warnings.

    What is checked is the config.json the run's export would write; its tensors come from the same
    config, so only the config rules apply. ``target_config``: the target directory's config, as read.
    ``refuse=False`` (a resume: the drafter is the one its checkpoint holds) returns the refusals among the
    warnings, each saying that the export will refuse it, instead of raising."""
    import torch

    data = drafter_config_dict(config, torch.float32)  # the dtype written names no rule
    check = ServingCheck(Path(target_dir), data=data, config=config)
    _config_rules(data, Path(target_dir), text_config(target_config), check)
    refused = check.refused()
    lines = [f"  - {f.subject}" + (f" ({TRAIN_FLAGS[f.subject]})" if f.subject in TRAIN_FLAGS else "")
             + f": {f.problem}. Fix: {f.fix}" for f in refused]
    if refused and not refuse:
        return [f"the drafter this run continues is one {engines()} would not load as it is trained "
                f"({count(refused)}); `draftline export` will refuse it until this is mended:\n" + "\n".join(lines),
                *check.warnings]
    if refused:
        raise DraftlineError(
            f"the drafter this run would train is one {engines()} would not load as it is trained, against the "
            f"target {target_dir} ({count(refused)}; rules read from their sources, not a run of their code); "
            "nothing was trained:\n" + "\n".join(lines))
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


def engine_mask_token_id(target_dir: str | Path, target_config: PretrainedConfig) -> int | None:
    """The id the engines will check the drafter's mask token against: SGLang's default mask token
    (``<|MASK|>``) in the target's tokenizer, where it has one inside the target's vocabulary."""
    token_id = tokenizer_id(Path(target_dir), SGLANG_DEFAULT_MASK_TOKEN)
    vocab_size = int(text_config(target_config).vocab_size)
    return token_id if token_id is not None and 0 <= token_id < vocab_size else None


def _inspect(path: Path, target_dir: Path | None, target: PretrainedConfig) -> ServingCheck:
    """Every check of the drafter in ``path`` against the target's text config ``target`` (and its
    tokenizer, with ``target_dir``)."""
    data, config, config_error = read_drafter_config(path)
    check = ServingCheck(path, data=data, config=config, config_error=config_error)
    _config_rules(data, target_dir, target, check)
    if is_dspark_config(data):
        check_dspark_files(path, data, check)
    else:
        check_files(path, data, check)
    return check


def _config_rules(data: dict, target_dir: Path | None, target: PretrainedConfig, check: ServingCheck) -> None:
    """The config rules of the drafter's layout: a DSpark drafter's (its fields at the top level, its heads), or
    the DFlash drafter's."""
    if is_dspark_config(data):
        check_dspark_config(data, target, check)
    else:
        check_config(data, target_dir, target, check)
