"""The model card of an export, read as a user reads it: its shell blocks run, the engines' arguments
checked against the exported drafter's own config.json.

The card's code blocks (and the commands ``export`` prints) run in bash with stand-ins for ``python``
and ``vllm`` on PATH that record their arguments and environment; what they received must serve the
drafter that was written: SGLang's ``--speculative-num-draft-tokens`` is the block size, vLLM's
``num_speculative_tokens`` the block size minus the anchor, and vLLM's V2 runner is asked for exactly
when the layer types are mixed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from draftline.checkpoint.export import save_drafter
from draftline.cli import main
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config

RECORDER = """#!/bin/sh
{ echo "${VLLM_USE_V2_MODEL_RUNNER-unset}"; printf '%s\\n' "$@"; } > "$CALLS/$(basename "$0")"
"""


def _run(script: str, tmp_path) -> dict[str, tuple[str, list[str]]]:
    """Run ``script`` in bash with recording stand-ins for the engines;
    {program: (VLLM_USE_V2_MODEL_RUNNER or 'unset', argv[1:])}."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    calls.mkdir(exist_ok=True)
    for program in ("python", "vllm"):
        (bin_dir / program).write_text(RECORDER)
        (bin_dir / program).chmod(0o755)
        (calls / program).unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", CALLS=str(calls))
    subprocess.run(["bash", "-euc", script], env=env, check=True, timeout=30)
    recorded = {}
    for path in calls.iterdir():
        v2, *argv = path.read_text().splitlines()
        recorded[path.name] = (v2, argv)
    return recorded


def _card_script(card: str, target, drafter) -> str:
    """The card's bash blocks in order, its variables set to real paths as the card asks the user to."""
    blocks = re.findall(r"```bash\n(.*?)```", card, re.S)
    assert len(blocks) == 3, card  # the variables, SGLang's command, vLLM's command
    assert re.search(r"^TARGET=", blocks[0], re.M) and re.search(r"^DRAFTER=", blocks[0], re.M)
    return "\n".join([blocks[0], f"TARGET='{target}'", f"DRAFTER='{drafter}'", *blocks[1:]])


def _flags(argv: list[str]) -> dict[str, str]:
    assert len(argv) % 2 == 0 and all(a.startswith("--") for a in argv[::2]), argv
    return dict(zip(argv[::2], argv[1::2]))


def _check_engines_serve(calls, written: dict, target, drafter) -> None:
    assert sorted(calls) == ["python", "vllm"]
    v2, argv = calls["python"]
    assert argv[:2] == ["-m", "sglang.launch_server"] and v2 == "unset"
    sglang = _flags(argv[2:])
    assert sglang["--model-path"] == str(target) and sglang["--speculative-draft-model-path"] == str(drafter)
    assert sglang["--speculative-algorithm"] == "DFLASH"
    assert int(sglang["--speculative-num-draft-tokens"]) == written["block_size"]

    v2, argv = calls["vllm"]
    assert argv[:2] == ["serve", str(target)]
    spec = json.loads(_flags(argv[2:])["--speculative-config"])
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": written["block_size"] - 1}
    assert v2 == ("1" if len(set(written["layer_types"])) > 1 else "unset")


@pytest.mark.parametrize("block_size,layer_types", [
    (8, ["sliding_attention", "full_attention"]),
    (5, ["full_attention", "full_attention"]),
    (16, ["sliding_attention", "sliding_attention", "full_attention"]),
    (12, ["sliding_attention", "sliding_attention"]),
])
def test_the_card_s_commands_serve_the_exported_drafter(qwen3_target, tmp_path, capsys, block_size, layer_types):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=len(layer_types),
                                  block_size=block_size, layer_types=layer_types, sliding_window=16,
                                  target_layer_ids=[1, 4, 5])
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(config).float(), tmp_path / "drafter", dtype=torch.float32)
    out = tmp_path / "my drafter"  # a space: every path must reach the engines as one argument
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(qwen3_target)]) == 0
    written = json.loads((out / "config.json").read_text())  # what the engines will read, not what was asked
    card = (out / "README.md").read_text()

    _check_engines_serve(_run(_card_script(card, qwen3_target, out), tmp_path), written, qwen3_target, out)
    printed = dict(re.findall(r"^  (SGLang|vLLM): +(.*)$", capsys.readouterr().out, re.M))
    _check_engines_serve(_run("\n".join(printed.values()), tmp_path), written, qwen3_target, out)

    # The description's figures are the written config's.
    dflash = written["dflash_config"]
    assert f"block size {written['block_size']};" in card
    assert f"target layers {dflash['target_layer_ids']} of {written['num_target_layers']}" in card
    assert f"mask token id {dflash['mask_token_id']}" in card
    assert f"{written['num_hidden_layers']} layers (" in card


def _check_dspark_engines_serve(calls, written: dict, target, drafter, vllm: bool) -> None:
    """SGLang's DSPARK gets the verified block (the anchor and the block's drafts: block_size + 1), vLLM's dspark the
    drafted tokens (block_size); a gated head has no vLLM command."""
    assert sorted(calls) == (["python", "vllm"] if vllm else ["python"])
    _, argv = calls["python"]
    sglang = _flags(argv[2:])
    assert sglang["--model-path"] == str(target) and sglang["--speculative-draft-model-path"] == str(drafter)
    assert sglang["--speculative-algorithm"] == "DSPARK"
    assert int(sglang["--speculative-num-draft-tokens"]) == written["block_size"] + 1
    if vllm:
        _, argv = calls["vllm"]
        assert argv[:2] == ["serve", str(target)]
        spec = json.loads(_flags(argv[2:])["--speculative-config"])
        assert spec == {"method": "dspark", "model": str(drafter), "num_speculative_tokens": written["block_size"]}


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_a_dspark_card_s_commands_serve_the_exported_drafter(qwen3_target, tmp_path, capsys, head_type):
    from draftline.model.dspark import DSparkDrafter, build_dspark_config

    config = build_dspark_config(build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2,
                                                      block_size=6, target_layer_ids=[1, 4]),
                                 markov_rank=8, markov_head_type=head_type)
    torch.manual_seed(0)
    save_drafter(DSparkDrafter(config).float(), tmp_path / "drafter", dtype=torch.float32)
    out = tmp_path / "my drafter"
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(qwen3_target)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3DSparkModel"] and written["markov_head_type"] == head_type
    card = (out / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", card, re.S)
    assert len(blocks) == (3 if head_type == "vanilla" else 2), card
    script = "\n".join([blocks[0], f"TARGET='{qwen3_target}'", f"DRAFTER='{out}'", *blocks[1:]])
    _check_dspark_engines_serve(_run(script, tmp_path), written, qwen3_target, out, vllm=head_type == "vanilla")
    printed = dict(re.findall(r"^  (SGLang|vLLM): +(.*)$", capsys.readouterr().out, re.M))
    if head_type == "gated":
        assert printed["vLLM"].startswith("(vLLM does not serve this drafter")
        printed.pop("vLLM")
    _check_dspark_engines_serve(_run("\n".join(printed.values()), tmp_path), written, qwen3_target, out,
                                vllm=head_type == "vanilla")
    assert f"block size {written['block_size']}: the anchor and {written['block_size'] - 1} masks in" in card
