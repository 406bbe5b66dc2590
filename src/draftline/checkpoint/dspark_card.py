"""The commands and model card of an exported DSpark drafter.

SGLang (``--speculative-algorithm DSPARK``) takes the verified block as ``--speculative-num-draft-tokens``:
its DSpark worker drafts ``gamma = num_draft_tokens - 1`` tokens and warns, only, when that differs from the
config's ``block_size`` (``dspark_components/dspark_config.py``), so it is given exactly: block_size + 1. vLLM
(method ``dspark``) drafts ``num_speculative_tokens`` slots from the anchor (``sample_from_anchor``, its
default): block_size. vLLM builds the vanilla Markov head only, so a gated drafter has no vLLM command.
"""

from __future__ import annotations

from draftline.checkpoint.model_card import (
    engine_command, is_mixed, serving_intro, shell_word, speculative_config_word,
)
from draftline.checkpoint.serving import MIXED_LAYERS_WARNING

VLLM_GATED = ("vLLM does not serve this drafter: its DSpark model builds the vanilla Markov head only (no gate_proj), "
              "so it refuses the gated head's tensors at load; serve it with SGLang, or train with "
              "markov_head_type vanilla")


def dspark_serving_commands(config, *, drafter: str = "$DRAFTER", target: str = "$TARGET") -> dict[str, str]:
    """{'sglang': command, 'vllm': command, or why vLLM does not serve it}."""
    block_size = int(config.block_size)
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if is_mixed(config) else ""
    spec = speculative_config_word({"method": "dspark", "model": drafter, "num_speculative_tokens": block_size})
    vllm = (f"{env}vllm serve {shell_word(target)} --speculative-config {spec}" if config.markov_head_type == "vanilla"
            else f"({VLLM_GATED})")
    return {
        "sglang": (f"python -m sglang.launch_server --model-path {shell_word(target)} --speculative-algorithm DSPARK "
                   f"--speculative-draft-model-path {shell_word(drafter)} "
                   f"--speculative-num-draft-tokens {block_size + 1}"),
        "vllm": vllm,
    }


def dspark_model_card(config, *, target_name: str, num_parameters: int, warnings: list[str] = ()) -> str:
    """README.md text for the exported DSpark drafter ``config`` of the target named ``target_name``."""
    types = list(config.layer_types)
    layers = ", ".join(f"{types.count(t)} x {t}" for t in dict.fromkeys(types))
    window = f", window {config.sliding_window}" if "sliding_attention" in types else ""
    commands = dspark_serving_commands(config)
    confidence = ("a confidence head on the hidden state and the previous token's Markov embedding"
                  if config.confidence_head_with_markov else "a confidence head on the hidden state"
                  if config.enable_confidence_head else "no confidence head")
    lines = [
        "# DSpark drafter",
        "",
        f"A DSpark speculative-decoding drafter for `{target_name}`, trained and exported by draftline: a DFlash "
        f"backbone, a {config.markov_head_type} Markov head of rank {config.markov_rank} and {confidence}.",
        "",
        f"- {config.num_hidden_layers} layers ({layers}{window}), hidden size {config.hidden_size}, "
        f"{num_parameters / 1e6:.1f}M parameters",
        f"- block size {config.block_size}: the anchor and {config.block_size - 1} masks in, {config.block_size} "
        f"drafted tokens out; target layers {config.dflash_config['target_layer_ids']} of {config.num_target_layers}; "
        f"mask token id {config.dflash_config['mask_token_id']}",
        "- no embedding or LM head: the drafter uses the target's",
        "",
        *serving_intro(target_name),
        *engine_command("SGLang", commands["sglang"]),
    ]
    if config.markov_head_type == "vanilla":
        lines += engine_command("vLLM", commands["vllm"])
    else:
        lines += [f"{VLLM_GATED}.", ""]
    lines.append(f"`--speculative-num-draft-tokens {config.block_size + 1}` is the verified block: the anchor and "
                 f"the {config.block_size} drafted tokens (SGLang drafts one fewer than it, and only warns when that "
                 f"differs from the config's block_size); vLLM's `num_speculative_tokens` is the drafted tokens, "
                 f"{config.block_size}.")
    notes = [w for w in warnings if w != MIXED_LAYERS_WARNING]
    if notes:
        lines += ["", "Notes from the export check:", ""] + [f"- {w}" for w in notes]
    return "\n".join(lines) + "\n"
