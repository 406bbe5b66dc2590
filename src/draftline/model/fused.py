"""Compiled training kernels for the drafter, applied from outside the model (CUDA only).

``compile_drafter`` compiles, in place, each decoder layer's two halves around the attention
kernel (``attention_inputs``: RMSNorm, q/k/v, q/k norms, RoPE, concatenation;
``attention_outputs_and_mlp``: o_proj, residual, RMSNorm, SwiGLU MLP), the context projection and
the final norm. Inductor fuses the elementwise work (norms, RoPE, SiLU * up, residual adds) into
the matmuls' neighbours, and its partitioner recomputes cheap elementwise results in backward
instead of storing them. The masked attention keeps its own compiled flex kernel
(``draftline.model.attention``), whose block mask changes every pass.

The functions are replaced on the instances (bound methods), so parameter names and the state
dict stay those of the eager model. The arithmetic is the same; only rounding of fused bf16
elementwise chains may differ.
"""

from __future__ import annotations

import torch

from draftline.model.drafter import DFlashDrafter


def compile_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """Compile the drafter's dense parts in place (see the module docstring); returns it."""
    for layer in drafter.layers:
        layer.attention_inputs = torch.compile(layer.attention_inputs, dynamic=True)
        layer.attention_outputs_and_mlp = torch.compile(layer.attention_outputs_and_mlp, dynamic=True)
    drafter.project_context = torch.compile(drafter.project_context, dynamic=True)
    drafter.norm.forward = torch.compile(drafter.norm.forward, dynamic=True)
    return drafter
