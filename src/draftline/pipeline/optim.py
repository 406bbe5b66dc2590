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


def scale_and_clip_grads_(params, scale: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Multiply the gradients by ``scale``, then clip their global norm to ``max_norm``, in ONE pass.

    The same result as ``_foreach_mul_(grads, scale)`` followed by ``clip_grad_norm_(max_norm)``
    (norm of the scaled gradients, factor ``max_norm / (norm + 1e-6)`` capped at 1), but the norm
    is taken of the unscaled gradients and both factors are applied together: one read-write pass
    over the fp32 gradients (4.2 GB for an 8B-shaped drafter, ~2 ms on an H200) instead of two.
    ``max_norm`` <= 0: no clipping. Returns the norm of the scaled gradients (a device tensor; no
    host synchronisation). Parameters without a gradient are skipped.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=scale.device)
    norms = torch._foreach_norm(grads, 2.0)
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) * scale.float()
    factor = scale.float()
    if max_norm > 0:
        factor = factor * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))
    return norm


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
