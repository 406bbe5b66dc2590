"""Compiled kernels for the drafter's training step and the target's feature pass, applied from
outside the models (CUDA only).

``compile_drafter`` compiles, in place, each decoder layer's two halves around the attention
kernel (``attention_inputs``: RMSNorm, q/k/v, q/k norms, RoPE, concatenation;
``attention_outputs_and_mlp``: o_proj, residual, RMSNorm, SwiGLU MLP), the context projection and
the final norm. Inductor fuses the elementwise work (norms, RoPE, SiLU * up, residual adds) into
the matmuls' neighbours. What the halves keep for backward is chosen by ``recompute``
(``draftline.model.recompute``): by default (``"cheap"``) only the outputs of their matrix products;
norms, the SwiGLU product and the bf16 copies of the weights are recomputed in backward. The masked
attention keeps its own compiled flex kernel (``draftline.model.attention``), whose block mask
changes every pass.

The functions are replaced on the instances (bound methods), so parameter names and the state
dict stay those of the eager model; calls without gradients or with an inference cache (evaluation
during training) run the eager code. The arithmetic is the same; only rounding of fused bf16
elementwise chains may differ.

``compile_target`` does the same for the frozen target's feature pass: each decoder layer it runs
(RMSNorm, q/k norms, RoPE, SwiGLU and residual adds around the matmuls and the flex kernel) in one
compiled function. The parts a layer of another kind holds stay eager where compiling them would
trace through data-dependent code: mixture-of-experts blocks (routing), and fla's kernels in a Gated DeltaNet, given
the documents' boundaries per pass. Such layers compile their norms and dense parts, and a Gated DeltaNet the two
stages around its kernels (``linear_attention.Stages``: its projections and gates; the gated norm and output
projection), one compiled function each for every layer. Decoding with the same model (evaluation in a colocated
run) runs the eager code.
"""

from __future__ import annotations

import torch

from draftline.model.drafter import ContextCache, DFlashDrafter
from draftline.model.linear_attention import Stages, gated_output, project_inputs
from draftline.model.target import TargetFeatures


def one_kernel_for_every_size() -> dict:
    """Inductor options for code compiled once for passes of every size.

    Inductor fuses a norm's two backward reductions (over each row, and over the rows for the weight's gradient)
    into one kernel only where the rows pass three thresholds (rows x columns >= 5 Mi, rows >= 2 x columns, rows
    >= 4,096), and with dynamic shapes it guards on each: a pass whose rows fall on the other side of one compiles
    the layer again. At the 27B shape on an H100 two of six drafter steps took 10-15 s so
    (docs/benchmarks/2026-12-the-card.md). The non-strict mode fuses without the thresholds, so one kernel serves
    every size; a torch without the option keeps its default."""
    import torch._inductor.config as inductor

    name = "mix_order_reduction_non_strict_mode"
    return {f"triton.{name}": True} if hasattr(inductor.triton, name) else {}


def _compiled_when(use_compiled, eager, compiled_fn=None):
    """``compiled_fn`` (default ``eager``) compiled (dynamic shapes, ``one_kernel_for_every_size``), called when
    ``use_compiled(args, kwargs)`` holds, and ``eager`` otherwise: the calls a model makes outside the pass it was
    compiled for stay as written."""
    compiled = torch.compile(compiled_fn or eager, dynamic=True, options=one_kernel_for_every_size())

    def call(*args, **kwargs):
        return (compiled if use_compiled(args, kwargs) else eager)(*args, **kwargs)

    return call


def _training_pass(args, kwargs) -> bool:
    """Gradients on and no inference cache. Evaluation during training (speculative decoding with a
    ``ContextCache``, under no_grad) runs the eager code it was written for, without guards on the
    cache or recompilation for one-block shapes."""
    return torch.is_grad_enabled() and not any(isinstance(a, ContextCache) for a in (*args, *kwargs.values()))


def _allow_entries(count: int) -> None:
    """Room in dynamo's cache for the variants of ``count`` compiled functions that share one code object. Every
    layer's halves, wrapped for recomputation, are one closure (``recompute.selective``'s ``run``): dynamo keys
    its cache by code object and adds an entry per half and per variant it guards on (which half, whether the
    input requires a gradient, a shape it specialised), and past ``recompile_limit`` (8 by default) the rest
    run eager, silently but for one warning: the 8B line on the H200 reached it."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * count + 8)


def compile_drafter(drafter: DFlashDrafter, recompute: str = "cheap") -> DFlashDrafter:
    """Compile the drafter's dense parts in place for training passes (see the module docstring).

    ``recompute``: what each layer's halves recompute in backward instead of keeping
    (``draftline.model.recompute.MODES``). Layers that ``checkpoint_layers`` recomputes whole keep nothing
    anyway: theirs stay as compiled (``"none"``)."""
    from draftline.model.recompute import selective

    _allow_entries(2 * len(drafter.layers))
    for layer in drafter.layers:
        mode = "none" if getattr(layer, "checkpointed", False) else recompute
        for name in ("attention_inputs", "attention_outputs_and_mlp"):
            eager = getattr(layer, name)
            lean = selective(eager, mode, intermediate_size=drafter.config.intermediate_size)
            setattr(layer, name, _compiled_when(_training_pass, eager, compiled_fn=lean))
    drafter.project_context = _compiled_when(_training_pass, drafter.project_context)
    drafter.norm.forward = _compiled_when(_training_pass, drafter.norm.forward)
    return drafter


def _dense_mlp(module: torch.nn.Module | None) -> bool:
    """A plain gated MLP (no routing): Qwen3MLP, LlamaMLP, Qwen3_5MLP, ..."""
    return module is not None and type(module).__name__.endswith("MLP") and not hasattr(module, "experts")


def compile_target(target: TargetFeatures) -> TargetFeatures:
    """Compile, in place, the decoder layers of the target's feature pass (see the module docstring)."""

    def compile_forward(module: torch.nn.Module) -> None:
        module.forward = _compiled_when(lambda _args, _kwargs: target.in_feature_pass(), module.forward)

    if target.hybrid and target.packed:  # fla's kernels stay outside; the work around them compiles
        target.linear_stages = Stages(*(torch.compile(fn, dynamic=True, options=one_kernel_for_every_size())
                                        for fn in (project_inputs, gated_output)))
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
