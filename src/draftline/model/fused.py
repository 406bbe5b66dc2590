"""Compiled kernels for the drafter's training step and the target's feature pass, applied from
outside the models (CUDA only).

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

``compile_target`` does the same for the frozen target's feature pass: each decoder layer it runs
(RMSNorm, q/k norms, RoPE, SwiGLU and residual adds around the matmuls and the flex kernel) in one
compiled function. The parts a layer of another kind holds stay eager where compiling them would
trace through data-dependent code: Gated DeltaNet (fla's kernels, given the documents' boundaries
per pass) and mixture-of-experts blocks (routing); their layers compile their norms and dense parts
only. Decoding with the same model (evaluation in a colocated run) runs the eager code.
"""

from __future__ import annotations

import torch

from draftline.model.drafter import ContextCache, DFlashDrafter
from draftline.model.target import TargetFeatures


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


def _dense_mlp(module: torch.nn.Module | None) -> bool:
    """A plain gated MLP (no routing): Qwen3MLP, LlamaMLP, Qwen3_5MLP, ..."""
    return module is not None and type(module).__name__.endswith("MLP") and not hasattr(module, "experts")


def compile_target(target: TargetFeatures) -> TargetFeatures:
    """Compile, in place, the decoder layers of the target's feature pass (see the module docstring)."""

    def in_feature_pass(eager, compiled):
        def call(*args, **kwargs):
            if target.in_feature_pass():
                return compiled(*args, **kwargs)
            return eager(*args, **kwargs)

        return call

    def compile_forward(module: torch.nn.Module) -> None:
        module.forward = in_feature_pass(module.forward, torch.compile(module.forward, dynamic=True))

    for layer in target.decoder.layers[: target.layers_run]:
        if not hasattr(layer, "linear_attn") and _dense_mlp(getattr(layer, "mlp", None)):
            compile_forward(layer)  # the whole layer: norms and residuals fuse with their neighbours
            continue
        parts = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm", "self_attn")]
        if _dense_mlp(getattr(layer, "mlp", None)):
            parts.append(layer.mlp)
        for part in parts:
            if part is not None:
                compile_forward(part)
    return target
