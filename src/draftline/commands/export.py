"""``draftline export CKPT_DIR OUT_DIR``: a drafter checkpoint servers load as it is."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftline.checkpoint.export import load_drafter, save_drafter
from draftline.checkpoint.locate import find_drafter_dir

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", type=Path, metavar="CKPT",
                        help="a run directory (its final/, else its latest whole checkpoint), a training "
                             "checkpoint (RUN_DIR/checkpoints/step-N) or a drafter directory")
    parser.add_argument("out_dir", type=Path, metavar="OUT",
                        help="the directory to write config.json + model.safetensors to, as DFlash, SGLang and "
                             "vLLM load them")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                        help="dtype of the written weights (default bfloat16, as servers run them; float32 keeps "
                             "the training precision)")


def run(args: argparse.Namespace) -> int:
    source = find_drafter_dir(args.ckpt_dir)
    drafter = load_drafter(source, dtype=torch.float32)
    save_drafter(drafter, args.out_dir, dtype=_DTYPES[args.dtype])
    params = sum(p.numel() for p in drafter.parameters())
    cfg = drafter.config
    print(f"exported {source} -> {args.out_dir}")
    print(f"  {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {params / 1e6:.1f}M parameters, "
          f"block_size {cfg.block_size}, target_layer_ids {cfg.dflash_config['target_layer_ids']}")
    print(f"  SGLang: --speculative-algorithm DFLASH --speculative-draft-model-path {args.out_dir} "
          f"--speculative-num-draft-tokens {cfg.block_size}")
    print(f"  vLLM:   speculative_config={{\"method\": \"dflash\", \"model\": \"{args.out_dir}\", "
          f"\"num_speculative_tokens\": {cfg.block_size - 1}}}")
    return 0
