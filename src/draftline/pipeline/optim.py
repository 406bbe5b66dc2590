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
    # Fused (one kernel over all tensors, on CPU as on CUDA): it takes the step's gradient factor and
    # a device-side skip flag inside the update (step_with_factor).
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), fused=True)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can leave out a step on a device flag (fused AdamW/Adam: ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def grad_factor(params, scale: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor that scales the gradients by ``scale`` and clips their global norm to ``max_norm``.

    Returns ``(factor, norm)``: ``norm`` is the global norm of the SCALED gradients, ``factor`` is
    ``scale * min(1, max_norm / (norm + 1e-6))`` (the same clipping rule as ``clip_grad_norm_``;
    ``max_norm`` <= 0: no clipping). Both are device tensors: no host synchronisation, and the
    gradients are read once (for their norms) and not written. Parameters without a gradient are
    skipped.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return scale.float(), torch.zeros((), device=scale.device)
    norms = torch._foreach_norm(grads, 2.0)
    norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms])) * scale.float()
    factor = scale.float()
    if max_norm > 0:
        factor = factor * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return factor, norm


def step_with_factor(optimizer: torch.optim.Optimizer, params, factor: torch.Tensor,
                     skip: torch.Tensor | None = None, chunks=None, after_chunk=None) -> None:
    """``optimizer.step()`` on the gradients multiplied by ``factor`` (a device scalar).

    A fused AdamW takes the factor inside its own kernel (as ``grad_scale``, the divisor it applies
    to each gradient as it reads it, the hook mixed-precision scalers use): no separate pass over
    the gradients (4.2 GB of fp32 reads and writes for an 8B-shaped drafter). Other optimizers get
    the gradients multiplied first. The gradients hold the multiplied values afterwards either way.

    ``skip`` (a device bool scalar; fused optimizers only, see ``skips_on_device``): where true, the
    kernel leaves the weights, moments and step counts as they were (``found_inf``, the other hook of
    mixed-precision scalers), so the update can be queued before the host knows whether the step
    is good.

    ``chunks`` (fused optimizers only): lists of parameters covering ``params``, updated one list at a
    time in this order, ``after_chunk(i)`` called after list ``i`` is queued (the drafter records an
    event there, so that a layer's next forward waits for its own update only). The result is the
    same, bit for bit, as one step over all: the update is elementwise per parameter.
    """
    if not skips_on_device(optimizer):
        if skip is not None:
            raise ValueError("only a fused optimizer skips a step on a device flag; decide on the host "
                             "and do not call step_with_factor for a skipped step")
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        optimizer.step()
        return
    optimizer.grad_scale = (1.0 / factor.float()).reshape(())
    if skip is not None:
        optimizer.found_inf = skip.float().reshape(())
    try:
        if chunks is None:
            optimizer.step()
        else:
            _step_in_chunks(optimizer, chunks, after_chunk)
    finally:
        del optimizer.grad_scale
        if skip is not None:
            del optimizer.found_inf


def _step_in_chunks(optimizer: torch.optim.Optimizer, chunks, after_chunk) -> None:
    """One ``optimizer.step()`` per chunk, each over the chunk's parameters with their own group's
    settings; the optimizer's groups are restored afterwards (its state is keyed by parameter)."""
    groups = optimizer.param_groups
    group_of = {p: i for i, group in enumerate(groups) for p in group["params"]}
    try:
        for index, chunk in enumerate(chunks):
            members = [[] for _ in groups]
            for p in chunk:
                members[group_of[p]].append(p)
            optimizer.param_groups = [dict(group, params=m) for group, m in zip(groups, members) if m]
            optimizer.step()
            if after_chunk is not None:
                after_chunk(index)
    finally:
        optimizer.param_groups = groups


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
