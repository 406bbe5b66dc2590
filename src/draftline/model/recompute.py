"""What a training pass of the drafter keeps for backward, and what it recomputes instead.

Autograd keeps every intermediate a backward formula reads. In a decoder layer's two halves around
the attention kernel (``DrafterLayer.attention_inputs`` and ``attention_outputs_and_mlp``) most of
those intermediates are cheap to recompute: the RMSNorms' outputs, the SwiGLU product ``silu(gate) *
up``, the transposed copy of the attention output that enters ``o_proj``, and the bf16 copy of every
fp32 weight that autocast makes for its matrix product (2 bytes per trained parameter, held from the
forward to the backward). Counted at the Qwen3-8B shape (8,192 query rows, 3,072 context rows): the
compiled halves keep 1,287 MiB a layer as the partitioner leaves them, 534 MiB with ``"cheap"``, 150 MiB
with ``"mlp"``; the attention kernel keeps another 173 MiB (bench/drafter_memory.py's prediction and its trace).

``selective(fn, mode, ...)`` runs ``fn`` under selective activation checkpointing
(``torch.utils.checkpoint`` with a policy): the outputs of matrix products are kept, everything else
``fn`` computes is recomputed in backward from them, from ``fn``'s inputs and from the fp32 weights.
Recomputing repeats the same operations on the same values and the backward formulas stay autograd's
own, so the results are those of the plain function, bit for bit in eager mode
(tests/model/test_recompute.py); hand-written autograd Functions for the norms, RoPE and SwiGLU would
change the order of the backward's arithmetic. Inside ``torch.compile`` (``model.fused``) the
partitioner follows the policy; there the fused kernels may round a bf16 chain differently than
before, as compilation itself does (tests/model/test_fused.py bounds it against fp32).

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
import logging

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
    _quiet_compile_notice()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context, preserve_rng_state=False, **kwargs)

    return run


class _InPlaceNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


def _quiet_compile_notice() -> None:
    """torch.compile warns, for every checkpointed region with a policy, to make sure it holds no in-place op;
    the drafter's halves hold none (``DrafterLayer``), so the warning is only noise at the start of every run."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _InPlaceNotice) for f in logger.filters):
        logger.addFilter(_InPlaceNotice())
