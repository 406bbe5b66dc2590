"""AdamW with fp32 master weights (fp32 moments, or bf16 ones on request) and a cosine schedule with linear warmup
(over the steps, or the clock)."""

from __future__ import annotations

import math

import torch

from draftline.config import OptimConfig
from draftline.distributed.shard import local_tensor
from draftline.pipeline.progress import Progress


MOMENTS = ("fp32", "bf16")


def build_optimizer(model: torch.nn.Module, config: OptimConfig, moments: str = "fp32") -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; norms and other 1-D tensors get no weight decay.

    ``moments``: 'fp32' (torch's fused AdamW: the exact update) or 'bf16' (``AdamWBf16Moments``: 4 bytes less
    per trained weight for each moment, a different update; see there)."""
    if moments not in MOMENTS:
        raise ValueError(f"AdamW moments must be one of {', '.join(MOMENTS)}, got {moments!r}")
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if moments == "bf16":
        return AdamWBf16Moments(groups, lr=config.lr, betas=tuple(config.betas))
    # Fused (one kernel over all tensors, on CPU as on CUDA): it takes the step's gradient factor and
    # a device-side skip flag inside the update (step_with_factor).
    return torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas), fused=True)


def _bf16_stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounded up or down at random in proportion to the distance (unbiased: E[result] = x)."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # low bits zero: an exact bf16


def adamw_bf16_moments_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                              grad_scale, skip) -> None:
    """One AdamW update of ``param`` (fp32) in place, with bf16 moments: torch.optim.AdamW's arithmetic in fp32
    on the moments read as fp32, the new moments stored rounded stochastically. Every scalar is a 0-d tensor (no
    recompilation as the learning rate moves); ``grad`` is divided by ``grad_scale``; where ``skip`` is nonzero
    nothing changes (the fused AdamW's ``found_inf``)."""
    g = grad.float() / grad_scale
    n = step + 1
    m = torch.lerp(exp_avg.float(), g, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    denom = v.sqrt() / (1 - beta2**n).sqrt() + eps
    new = param * (1 - lr * weight_decay) - (lr / (1 - beta1**n)) * (m / denom)
    keep = skip != 0
    param.copy_(torch.where(keep, param, new))
    exp_avg.copy_(torch.where(keep, exp_avg, _bf16_stochastic(m)))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, _bf16_stochastic(v)))
    step.copy_(torch.where(keep, step, n))


class AdamWBf16Moments(torch.optim.Optimizer):
    """AdamW on fp32 weights whose two moments are held in bf16 (4 bytes per trained weight instead of 8).

    Not the exact update: each step's new moments are rounded to bf16 stochastically (unbiased), which a
    beta2 near 1 needs (deterministic rounding would leave a slowly moving moment where it is). The arithmetic
    of a step is torch.optim.AdamW's, in fp32. Like the fused AdamW it takes the step's gradient factor and a
    device-side skip flag (``grad_scale``, ``found_inf``: ``step_with_factor``). On CUDA each tensor's update is
    one compiled kernel. Its moments are saved in bf16 and stay bf16 when a checkpoint is loaded."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      fused=True))  # fused: the update takes grad_scale and found_inf
        self._update = None
        self.register_load_state_dict_post_hook(AdamWBf16Moments._moments_to_bf16)

    @staticmethod
    def _moments_to_bf16(optimizer) -> None:
        """``Optimizer.load_state_dict`` casts every floating state to its parameter's dtype; the moments go back."""
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    def _update_fn(self, device: torch.device):
        if device.type != "cuda":
            return adamw_bf16_moments_update
        if self._update is None:
            self._update = torch.compile(adamw_bf16_moments_update, dynamic=True)
        return self._update

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamWBf16Moments.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = local_tensor(params[0]).device

            def scalar(value):  # a fill on the device: no host-to-device copy (which would wait for the device)
                return torch.full((), float(value), dtype=torch.float32, device=device)

            beta1, beta2 = group["betas"]
            lr, b1, b2, eps, wd = (scalar(v) for v in (group["lr"], beta1, beta2, group["eps"], group["weight_decay"]))
            grad_scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
            grad_scale = scalar(1.0) if grad_scale is None else grad_scale.to(device, torch.float32)
            skip = scalar(0.0) if found_inf is None else found_inf.to(device, torch.float32)
            update = self._update_fn(device)
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                update(local_tensor(p), local_tensor(p.grad), local_tensor(state["exp_avg"]),
                       local_tensor(state["exp_avg_sq"]), state["step"], lr, b1, b2, eps, wd, grad_scale, skip)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can leave out a step on a device flag (fused AdamW/Adam: ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def grad_norm(params) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients (a device scalar: no host sync); those without a
    gradient are skipped. Sharded parameters: the norm of this rank's shards (``grad_sq_norm`` is then what
    the drafters sum)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]))


def grad_sq_norm(params) -> torch.Tensor:
    """The squared L2 norm of this rank's gradient shards (float64): summed over the drafters, the square of
    the global norm."""
    return grad_norm(params).double() ** 2


def clip_factor(scale: torch.Tensor, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``scale * min(1, max_norm / (norm + 1e-6))``: scales the gradients by ``scale`` and clips the global
    norm of the scaled gradients (``norm``) to ``max_norm``, the rule of ``clip_grad_norm_``; ``max_norm`` <= 0:
    no clipping."""
    factor = scale.float()
    if max_norm > 0:
        factor = factor * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return factor


def grad_factor(params, scale: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(factor, norm)`` for gradients held whole on this rank: ``norm`` is the global norm of the SCALED
    gradients, ``factor`` the ``clip_factor``. Both are device tensors; the gradients are read once (for their
    norms) and not written."""
    if not any(p.grad is not None for p in params):
        return scale.float(), torch.zeros((), device=scale.device)
    norm = grad_norm(params) * scale.float()
    return clip_factor(scale, norm, max_norm), norm


def step_with_factor(optimizer: torch.optim.Optimizer, params, factor: torch.Tensor,
                     skip: torch.Tensor | None = None) -> None:
    """``optimizer.step()`` on the gradients multiplied by ``factor`` (a device scalar).

    A fused AdamW takes the factor inside its own kernel (as ``grad_scale``, the divisor it applies
    to each gradient as it reads it, the hook mixed-precision scalers use): no separate pass over
    the gradients (4.2 GB of fp32 reads and writes for an 8B-shaped drafter). Other optimizers get
    the gradients multiplied first. The gradients hold the multiplied values afterwards either way.

    ``skip`` (a device bool scalar; fused optimizers only, see ``skips_on_device``): where true, the
    kernel leaves the weights, moments and step counts as they were (``found_inf``, the other hook of
    mixed-precision scalers), so the update can be queued before the host knows whether the step
    is good.
    """
    if not skips_on_device(optimizer):
        if skip is not None:
            raise ValueError("only a fused optimizer skips a step on a device flag; decide on the host "
                             "and do not call step_with_factor for a skipped step")
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor.to(local_tensor(grads[0]).dtype))
        optimizer.step()
        return
    optimizer.grad_scale = (1.0 / factor.float()).reshape(())
    if skip is not None:
        optimizer.found_inf = skip.float().reshape(())
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
        if skip is not None:
            del optimizer.found_inf


def lr_factor(step: float, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based, before the update; a fraction of a step
    where the schedule follows the clock, ``Schedule``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """Linear warmup, then a cosine down to ``min_lr_ratio`` of the peak, over the run's progress.

    The progress is the steps taken over ``total_steps``. Under a time limit (--max-minutes) it is the
    share of the training's time spent where that is further along (``Progress.clock``, which the drafters
    agree on at each step): a run that the clock ends also ends with its learning rate at the floor, instead
    of where the cosine stood. Without a time limit the clock stays 0 and the schedule is the steps' alone.
    The clock is the run's progress (``progress``), read here and saved with it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int,
                 progress: Progress | None = None):
        self.total_steps = total_steps
        self.warmup_steps = int(round(config.warmup_ratio * total_steps))
        self.min_ratio = config.min_lr_ratio
        self.run_progress = progress if progress is not None else Progress()
        super().__init__(optimizer, lambda step: self.factor(step))

    @property
    def clock(self) -> float:
        """The share of the time limit spent, 0 to 1 (0: no time limit)."""
        return self.run_progress.clock

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rate for ``step`` (0-based)."""
        return lr_factor(max(step, self.clock * self.total_steps), self.total_steps, self.warmup_steps, self.min_ratio)

    def progress(self, step: int) -> float:
        """How far along the schedule is at ``step``, 0 to 1."""
        return min(1.0, max(step / max(1, self.total_steps), self.clock))

    # The schedule's shape comes from this run's config (a resume may change the steps), not the checkpoint; the
    # clock is the progress's (a checkpoint written before it was held the clock here: the checkpoint's loader
    # hands it to the progress).
    _NOT_SAVED = ("total_steps", "warmup_steps", "min_ratio", "run_progress", "clock")

    def state_dict(self) -> dict:
        return {key: value for key, value in super().state_dict().items() if key not in self._NOT_SAVED}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({key: value for key, value in state_dict.items() if key not in self._NOT_SAVED})


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int,
                    progress: Progress | None = None) -> Schedule:
    return Schedule(optimizer, config, total_steps, progress)
