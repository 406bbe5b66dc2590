"""How long a checkpoint save stalls training, against how long the write takes (CPU or GPU).

    python bench/bench_checkpoint.py [--layers 4] [--hidden 1024]

A drafter with its AdamW state: ``save_checkpoint`` returns after the copy to host memory; the
background write (files, fsync, manifest with checksums, rename) is timed with ``wait_for_checkpoint``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import Qwen3Config

from draftline.checkpoint.state import TrainerState, save_checkpoint
from draftline.checkpoint.writer import wait_for_checkpoint
from draftline.config import OptimConfig
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.pipeline.optim import build_optimizer, build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="drafter layers (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="hidden size; the MLP is 3x (default: %(default)s: a 55M-parameter drafter, 0.6 GiB with AdamW)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the drafter lives (default: cuda when present)")
    args = parser.parse_args()
    target = Qwen3Config(vocab_size=1000, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=28,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
    drafter = DFlashDrafter(build_drafter_config(target, num_hidden_layers=args.layers, block_size=16)).to(args.device).float()
    params = sum(p.numel() for p in drafter.parameters())
    optimizer = build_optimizer(drafter, OptimConfig())
    scheduler = build_scheduler(optimizer, OptimConfig(), 10)
    sum(p.pow(2).sum() for p in drafter.parameters()).backward()
    optimizer.step()
    out = tempfile.mkdtemp(prefix="draftline-ckpt-")
    for step in (1, 2):
        state = TrainerState(step, step, [], {}, {})
        started = time.perf_counter()
        save_checkpoint(out, drafter=drafter, optimizer=optimizer, scheduler=scheduler, state=state, keep=3)
        returned = time.perf_counter() - started
        wait_for_checkpoint()
        written = time.perf_counter() - started
        print(f"{params / 1e6:.0f}M parameters ({params * 12 / 2**30:.2f} GiB with AdamW state, {args.device}): "
              f"save_checkpoint returned in {returned:.2f} s; written {written:.2f} s after the call")


if __name__ == "__main__":
    main()
