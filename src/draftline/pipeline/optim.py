"""AdamW with fp32 master weights and a cosine schedule with linear warmup."""

from __future__ import annotations

import math

import torch

from draftline.config import OptimConfig


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; norms and other 1-D tensors get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = any(p.is_cuda for p in decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), fused=on_cuda or None)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based, before the update)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    warmup = int(round(config.warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, config.min_lr_ratio)
    )
