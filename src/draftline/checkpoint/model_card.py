"""The model card written beside an exported drafter: what it is and the commands that serve it.

The commands follow the engine versions the serving check was read from (``ENGINES_READ``): SGLang
takes the block size as ``--speculative-num-draft-tokens`` (it overrides the config's block_size
with only a warning, so it is given exactly); vLLM drafts ``num_speculative_tokens`` slots after the
anchor, block_size - 1.
"""

from __future__ import annotations

import json
import shlex

from draftline.checkpoint.serving import ENGINES_READ, MIXED_LAYERS_WARNING

CARD_NAME = "README.md"


def serving_commands(config, *, drafter: str = "$DRAFTER", target: str = "$TARGET") -> dict[str, str]:
    """Shell commands that serve ``config``'s drafter with ``target``: {'sglang': ..., 'vllm': ...}.

    ``drafter`` and ``target`` are paths or shell variables (``$NAME``); either way the commands are
    what bash must be given: a path quoted, a variable in double quotes (also inside vLLM's JSON, where
    single quotes would hand vLLM the variable's name instead of its value).
    """
    if getattr(config, "markov_rank", None) is not None:  # a DSpark drafter: its own layout (checkpoint.dspark_card)
        from draftline.checkpoint.dspark_card import dspark_serving_commands

        return dspark_serving_commands(config, drafter=drafter, target=target)
    block_size = int(config.block_size)
    spec_word = speculative_config_word({"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1})
    # Mixed layer types need vLLM's V2 model runner (the serving check warns about them).
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if is_mixed(config) else ""
    return {
        "sglang": (f"python -m sglang.launch_server --model-path {shell_word(target)} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {shell_word(drafter)} --speculative-num-draft-tokens {block_size}"),
        "vllm": f"{env}vllm serve {shell_word(target)} --speculative-config {spec_word}",
    }


def speculative_config_word(spec: dict) -> str:
    """vLLM's ``--speculative-config`` JSON as one shell word: in double quotes where its model is a shell
    variable (expanded), else quoted as needed."""
    text = json.dumps(spec)
    if str(spec.get("model", "")).startswith("$"):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return shlex.quote(text)


def shell_word(value: str) -> str:
    """``value`` as one shell word: a variable in double quotes (expanded), anything else quoted as needed."""
    return f'"{value}"' if value.startswith("$") else shlex.quote(value)


def serving_intro(target_name: str) -> list[str]:
    """The card's serving section up to the engines' commands: the two paths they take."""
    return ["## Serving", "", "Set `TARGET` to the target model's directory or hub id and `DRAFTER` to this directory:",
            "", "```bash", f"TARGET={shlex.quote('/path/to/' + target_name)}", "DRAFTER=/path/to/this/directory", "```",
            ""]


def engine_command(engine: str, command: str) -> list[str]:
    """One engine's serving command in the card, with the engine's version its rules were read from."""
    return [f"{engine} (read: {ENGINES_READ[engine]}):", "", "```bash", command, "```", ""]


def is_mixed(config) -> bool:
    types = list(getattr(config, "layer_types", None) or [])
    return 0 < types.count("sliding_attention") < len(types)


def model_card(config, *, target_name: str, num_parameters: int, warnings: list[str] = ()) -> str:
    """README.md text for the exported drafter ``config`` of the target named ``target_name``."""
    if getattr(config, "markov_rank", None) is not None:  # a DSpark drafter: its own layout (checkpoint.dspark_card)
        from draftline.checkpoint.dspark_card import dspark_model_card

        return dspark_model_card(config, target_name=target_name, num_parameters=num_parameters, warnings=warnings)
    dflash = config.dflash_config
    types = list(config.layer_types)
    layers = ", ".join(f"{types.count(t)} x {t}" for t in dict.fromkeys(types))
    window = f", window {config.sliding_window}" if "sliding_attention" in types else ""
    commands = serving_commands(config)
    lines = [
        "# DFlash drafter",
        "",
        f"A DFlash speculative-decoding drafter for `{target_name}`, trained and exported by draftline.",
        "",
        f"- {config.num_hidden_layers} layers ({layers}{window}), hidden size {config.hidden_size}, "
        f"{num_parameters / 1e6:.1f}M parameters",
        f"- block size {config.block_size}; target layers {dflash['target_layer_ids']} of "
        f"{config.num_target_layers}; mask token id {dflash['mask_token_id']}",
        "- no embedding or LM head: the drafter uses the target's",
        "",
        *serving_intro(target_name),
        *engine_command("SGLang", commands["sglang"]),
        *engine_command("vLLM", commands["vllm"]),
        f"`--speculative-num-draft-tokens {config.block_size}` is the block size (SGLang would otherwise take "
        f"the config's, and overrides it with only a warning); vLLM's `num_speculative_tokens` is the "
        f"block size minus the anchor, {config.block_size - 1}.",
    ]
    if is_mixed(config):
        lines += ["", "This drafter mixes sliding-window and full-attention layers: vLLM runs it only on its V2 model "
                  "runner, hence `VLLM_USE_V2_MODEL_RUNNER=1` (vLLM refuses the drafter on its V1 runner)."]
    notes = [w for w in warnings if w != MIXED_LAYERS_WARNING]
    if notes:
        lines += ["", "Notes from the export check:", ""] + [f"- {w}" for w in notes]
    return "\n".join(lines) + "\n"
