"""Compiled training kernels for the drafter, applied from outside the model (CUDA only).

``compile_drafter`` compiles, in place, each decoder layer's two halves around the attention
kernel (``attention_inputs``: RMSNorm, q/k/v, q/k norms, RoPE, concatenation;
``attention_outputs_and_mlp``: o_proj, residual, RMSNorm, SwiGLU MLP), the context projection and
the final norm. Inductor fuses the elementwise work (norms, RoPE, SiLU * up, residual adds) into
the matmuls' neighbours, and its partitioner recomputes cheap elementwise results in backward
instead of storing them. The masked attention keeps its own compiled flex kernel
(``draftline.model.attention``), whose block mask changes every pass.

The functions are replaced on the instances (bound methods), so parameter names and the state
dict stay those of the eager model; calls without gradients or with an inference cache (evaluation
during training) run the eager code. The arithmetic is the same; only rounding of fused bf16
elementwise chains may differ.
"""

from __future__ import annotations

import torch

from draftline.model.drafter import ContextCache, DFlashDrafter


def _training_only(eager, compiled):
    """Call ``compiled`` in training passes (gradients on, no inference cache), ``eager`` otherwise.

    Evaluation during training (speculative decoding with a ``ContextCache``, under no_grad) then
    runs the eager code it was written for, without guards on the cache or recompilation for
    one-block shapes.
    """

    def call(*args, **kwargs):
        if torch.is_grad_enabled() and not any(isinstance(a, ContextCache) for a in (*args, *kwargs.values())):
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    return call


def compile_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """Compile the drafter's dense parts in place for training passes (see the module docstring)."""
    for layer in drafter.layers:
        for name in ("attention_inputs", "attention_outputs_and_mlp"):
            eager = getattr(layer, name)
            setattr(layer, name, _training_only(eager, torch.compile(eager, dynamic=True)))
    drafter.project_context = _training_only(drafter.project_context,
                                             torch.compile(drafter.project_context, dynamic=True))
    drafter.norm.forward = _training_only(drafter.norm.forward, torch.compile(drafter.norm.forward, dynamic=True))
    return drafter
