"""The rules on a drafter's files: model.safetensors (names and shapes) and what lies beside it."""

from __future__ import annotations

from pathlib import Path

from draftline.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME
from draftline.checkpoint.serving.config_rules import dflash_section
from draftline.checkpoint.serving.findings import SGLANG, SPECULATORS, VLLM, ServingCheck


def check_files(path: Path, data: dict, check: ServingCheck, extra_tensors: dict | None = None) -> None:
    """The files in ``path`` and, where there is one, its weights file against ``data`` (its config.json);
    ``extra_tensors``: a method's heads (name -> shape) the engines map beside the backbone's."""
    _check_files(path, check)
    if (path / WEIGHTS_NAME).is_file():
        _check_tensors(path, data, check, extra_tensors or {})


def _check_files(path: Path, check: ServingCheck) -> None:
    if not (path / WEIGHTS_NAME).is_file():
        check.add("model.safetensors", WEIGHTS_NAME, "missing", "export the drafter with draftline export")
    for other in sorted(path.iterdir()):
        if other.name == WEIGHTS_NAME:
            continue
        if other.suffix == ".safetensors" or other.name.endswith(".safetensors.index.json"):
            check.add("weight_files", other.name, f"{VLLM} loads every *.safetensors file in the drafter's directory "
                      "(and an index names the shards)", f"remove {other.name}")
        elif other.name == "mask_embedding.pt":
            check.add("mask_embedding.pt", other.name, f"{VLLM} and {SGLANG} put it in place of the mask token's "
                      "embedding row, which draftline trains with", f"remove {other.name}")
        elif other.name == "hf_quant_config.json":
            check.add("quantization", other.name, f"{VLLM} and {SGLANG} read the drafter's quantization from it when "
                      "config.json has none; draftline writes the weights unquantized", f"remove {other.name}")


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
    ids = dflash_section(data).get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("no target_layer_ids: fc's width is unknown")
    return Qwen3Config.from_dict({**{k: v for k, v in data.items() if k not in skip}, "block_size": 2,
                                  "dflash_config": dflash_section(data)})


def _is_vocab_map(name: str) -> bool:
    return "d2t" in name or "t2d" in name


def _check_tensors(path: Path, data: dict, check: ServingCheck, extra_tensors: dict) -> None:
    from safetensors import safe_open

    add = check.add
    try:
        config = _sizes_config(data)
        expected = {**expected_tensors(config), **extra_tensors}
    except Exception:  # noqa: BLE001 - sizes that build no drafter; the findings on config.json name them
        if not check.findings:
            add("sizes", CONFIG_NAME, "its sizes build no drafter", "export the drafter with draftline export")
        return
    with safe_open(path / WEIGHTS_NAME, framework="pt", device="cpu") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    prefixed = sorted(n for n in shapes if n.startswith("model."))
    if prefixed:
        add("model_prefix", prefixed[0] + (f" (and {len(prefixed) - 1} more)" if len(prefixed) > 1 else ""),
            f"has a 'model.' prefix; {VLLM} prepends 'model.' itself and refuses the doubled name, {SGLANG} strips it",
            "save the tensors without the prefix")
    names = {n.removeprefix("model.") for n in shapes}
    shared = sorted(n for n in names if n.split(".")[0] in ("embed_tokens", "lm_head"))
    for name in shared:
        add("embed_tokens_lm_head", name, f"a drafter borrows the target's embedding and LM head: with this tensor "
            f"present {VLLM} uses the drafter's copy where it differs from the target's, {SGLANG} and the "
            f"{SPECULATORS} converter the target's", f"remove {name}")
    maps = sorted(n for n in names if _is_vocab_map(n) and n not in expected)
    if maps:
        add("vocab_map", ", ".join(maps), f"a draft-to-target vocabulary map: {VLLM} loads 'd2t' as the map of a "
            "smaller draft_vocab_size (and refuses it without one) and skips 't2d'; "
            f"{SGLANG} skips both; draftline's drafter predicts over the target's whole vocabulary",
            f"remove {', '.join(maps)}")
    unknown = sorted(names - set(expected) - set(shared) - set(maps))
    if unknown:
        add("unknown_tensors", ", ".join(unknown[:6]) + (" ..." if len(unknown) > 6 else ""),
            f"{len(unknown)} tensor{'s' if len(unknown) > 1 else ''} no engine maps ({SGLANG} skips unknown tensors "
            f"without a word; {VLLM} refuses them at start, except names ending in '.bias' and HF rotary caches, "
            "which it skips)", "remove them, or rename them to the names of the drafter's modules")
    missing = sorted(set(expected) - names)
    if missing:
        add("missing_tensors", ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""),
            f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} the engines map "
            f"{'is' if len(missing) == 1 else 'are'} missing (neither {VLLM} nor {SGLANG} reports a missing "
            "tensor: the parameter keeps whatever memory it was given)",
            f"save every tensor of the {config.num_hidden_layers}-layer drafter")
    for name in sorted(set(expected) & names):
        shape = shapes.get(name, shapes.get("model." + name))
        if shape != expected[name]:
            add("tensor_shape", name, f"has shape {shape}, the config needs {expected[name]}",
                "save the tensor the config describes (or fix the config's sizes)")
