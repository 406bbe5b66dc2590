"""What a training pass of the drafter keeps for backward, and what it recomputes instead.

Autograd keeps every intermediate a backward formula reads. In a decoder layer's two halves around
the attention kernel (``DrafterLayer.attention_inputs`` and ``attention_outputs_and_mlp``) most of
those intermediates are cheap to recompute: the RMSNorms' outputs, the SwiGLU product ``silu(gate) *
up``, the transposed copy of the attention output that enters ``o_proj``, and the bf16 copy of every
fp32 weight that autocast makes for its matrix product (2 bytes per trained parameter, held from the
forward to the backward). At the Qwen3-8B shape (8,192 query rows) they are ~0.75 GiB of a layer's
~1.5 GiB.

``selective(fn, mode, ...)`` runs ``fn`` under selective activation checkpointing
(``torch.utils.checkpoint`` with a policy): the outputs of matrix products are kept, everything else
``fn`` computes is recomputed in backward from them, from ``fn``'s inputs and from the fp32 weights.
Recomputing repeats the same operations on the same values, so the results are those of the plain
function, bit for bit in eager mode (tests/model/test_recompute.py). Inside ``torch.compile`` the
policy is what the partitioner follows (``model.fused``): it decides what the compiled backward reads,
where a custom autograd Function's own choice would not survive the partitioner.

Modes:

- ``"none"``: ``fn`` as it is (autograd's choice; under compilation, the partitioner's).
- ``"cheap"``: keep matrix products' outputs, recompute the rest (elementwise work, norms, weight casts).
- ``"mlp"``: as ``"cheap"``, and the MLP's gate and up projections are recomputed too (two matrix
  products per layer, ~2/3 of the MLP's forward FLOPs again in backward) instead of keeping their
  ``[rows, intermediate_size]`` outputs. Recognised by their width: with ``intermediate_size`` equal
  to another projection's width, that projection is recomputed too (slower, same result).
"""

from __future__ import annotations

import functools

import torch

MODES = ("none", "cheap", "mlp")

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _policy(mode: str, intermediate_size: int):
    from torch.utils.checkpoint import CheckpointPolicy

    def choose(_ctx, op, *args, **_kwargs):
        if op in _MATMULS:
            if mode == "mlp" and args[-1].shape[-1] == intermediate_size:  # x @ W.t() with W [intermediate, hidden]
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return choose


def selective(fn, mode: str, *, intermediate_size: int):
    """``fn`` keeping only what ``mode`` keeps for backward (see the module docstring). ``fn`` must be free of
    randomness and in-place updates of its inputs (the drafter's halves are)."""
    if mode not in MODES:
        raise ValueError(f"recompute mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return fn
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _policy(mode, intermediate_size))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context, preserve_rng_state=False, **kwargs)

    return run
