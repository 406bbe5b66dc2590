"""``draftline export CKPT_DIR OUT_DIR``: a drafter checkpoint servers load as it is.

What is written is checked against the target by the serving check (``checkpoint/serving``: rules read
from vLLM's and SGLang's sources at named versions, not a run of their code) before it is moved into
place: a drafter those engines would load differently from how it was trained is refused and nothing is
written. A model card (README.md) with the serving commands goes
beside the weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.checkpoint.locate import find_drafter_dir
from draftline.checkpoint.model_card import CARD_NAME, model_card
from draftline.checkpoint.serving import ENGINES_READ, inspect_drafter_dir
from draftline.errors import DraftlineError
from draftline.methods import method_for

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", type=Path, metavar="CKPT",
                        help="a run directory (its final/, else its latest whole checkpoint), a training "
                             "checkpoint (RUN_DIR/checkpoints/step-N) or a drafter directory")
    parser.add_argument("out_dir", type=Path, metavar="OUT",
                        help="the directory to write config.json + model.safetensors to, as DFlash, SGLang and "
                             "vLLM load them (a DSpark drafter in the layout of their DSpark loaders), with a "
                             "README.md model card")
    parser.add_argument("--target", type=Path, default=None,
                        help="the target model directory the drafter is checked against (default: the one recorded "
                             "in the run directory's config.json)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="dtype of the written weights (default bfloat16, as servers run them; float32 keeps "
                             "the training precision)")


def recorded_target(ckpt_dir: Path) -> Path | None:
    """The target named in the run's ``config.json`` (``model.target``) at or above ``ckpt_dir``."""
    ckpt_dir = ckpt_dir.resolve()
    for folder in (ckpt_dir, *list(ckpt_dir.parents)[:3]):  # RUN, RUN/final, RUN/checkpoints/step-N/drafter
        config_file = folder / "config.json"
        if not config_file.is_file():
            continue
        try:
            model = json.loads(config_file.read_text()).get("model")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(model, dict) and model.get("target"):
            return Path(model["target"])
    return None


def _target_dir(args: argparse.Namespace) -> Path:
    target = args.target or recorded_target(args.ckpt_dir)
    if target is None:
        raise DraftlineError(
            f"{args.ckpt_dir}: no target recorded (no run config.json with model.target at or above it); export "
            "checks the drafter against its target: pass --target DIR"
        )
    if not (target / "config.json").is_file():
        source = "--target" if args.target else "the run's config.json (model.target)"
        raise DraftlineError(f"{target} (from {source}) is not a model directory here: pass --target DIR")
    return target


def run(args: argparse.Namespace) -> int:
    source = find_drafter_dir(args.ckpt_dir)
    target_dir = _target_dir(args)
    drafter = load_drafter(source, dtype=torch.float32)
    params = sum(p.numel() for p in drafter.parameters())
    cfg = drafter.config
    warnings: list[str] = []

    def check_and_describe(tmp: Path) -> None:
        check = inspect_drafter_dir(tmp, target_dir)
        check.path = args.out_dir  # name the destination, not the temporary directory
        check.raise_if_refused()
        warnings.extend(check.warnings)
        card = model_card(cfg, target_name=target_dir.resolve().name, num_parameters=params, warnings=check.warnings)
        (tmp / CARD_NAME).write_text(card)

    save_drafter(drafter, args.out_dir, dtype=_DTYPES[args.dtype], finish=check_and_describe)
    read = " and ".join(f"{name} {version}" for name, version in ENGINES_READ.items())
    print(f"exported {source} -> {args.out_dir} (checked against the target {target_dir} by draftline's serving "
          f"rules, read from the sources of {read}; no engine code was run)")
    method = method_for(cfg)
    print(f"  {method.describe(cfg)}; {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{params / 1e6:.1f}M parameters, block_size {cfg.block_size} ({method.drafts_per_block(cfg.block_size)} "
          f"drafted tokens per step), target_layer_ids {cfg.dflash_config['target_layer_ids']}")
    for warning in warnings:
        print(f"  warning: {warning}")
    commands = method.serving_commands(cfg, drafter=str(args.out_dir), target=str(target_dir))
    print(f"  SGLang: {commands['sglang']}")
    print(f"  vLLM:   {commands['vllm']}")
    print(f"  model card: {args.out_dir / CARD_NAME}")
    return 0
