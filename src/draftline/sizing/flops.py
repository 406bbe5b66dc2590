"""Model FLOPs: the project's one counter (docs/FLOPS.md), layer by layer.

The convention, as the functions below apply it:

- Linear layer, one row: forward ``2*in*out``; backward ``4*in*out`` when its input needs a
  gradient (input gradient + weight gradient), ``2*in*out`` (weight gradient only) when it does
  not. A frozen linear costs its forward, plus ``2*in*out`` if a gradient flows through it.
- Softmax attention, one query row, one layer: forward ``4*heads*head_dim*visible_keys`` (QK^T
  and PV); backward twice that. Full attention sees the document so far (quadratic per
  document), sliding attention at most its window.
- Linear attention (Gated DeltaNet), one token, one layer: its projections as linears, the
  depthwise causal conv ``2*kernel*channels``, and the recurrent state update ``6*dk*dv`` per
  value head (read ``k^T S``, rank-one write, read ``S q``): linear in the sequence length.
- MoE MLP: the experts a token runs, the shared expert and the router; idle experts earn nothing.
- Target: forward only, only the layers that must run (up to the deepest feature layer; all of them
  where the method or soft labels need its final hidden state), no LM head. Drafter: one training pass
  (forward + backward), with what its method adds (DSpark's heads); see ``drafter_flops_breakdown``.

Only model FLOPs count: norms, RoPE, softmax, gates' elementwise work, the loss, padding and
masked-out keys earn nothing, so MFU is comparable across implementations (flex vs dense
attention, chunked vs recurrent linear attention, chunked heads, ...). Shapes come from
``sizing/shapes.py``, the reference workload from ``sizing/workload.py``, peaks and MFU from
``sizing/peak.py`` (the shapes' and peaks' names are importable from here too).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftline.objective.dspark_blocks import distinct_teacher_rows
from draftline.sizing.peak import (  # noqa: F401  (bench/ imports these from here)
    GpuSpec,
    PeakFlops,
    format_flops,
    gpu_spec,
    known_peak,
    measure_peak_flops,
    mfu,
    resolve_peak,
)
from draftline.sizing.shapes import (  # noqa: F401
    FULL,
    LINEAR,
    SLIDING,
    DecoderShape,
    DrafterShape,
    LayerShape,
    MethodShape,
    TargetShape,
)

# ---------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------


def linear_flops(rows: float, in_features: int, out_features: int, *, backward: bool = False,
                 input_grad: bool = True) -> float:
    """FLOPs of ``rows`` rows through one linear: forward, plus backward when ``backward``.

    Backward is ``4*in*out`` per row with ``input_grad`` (input and weight gradients), else
    ``2*in*out`` (only the weight gradient, or only the input gradient of a frozen linear).
    """
    return weight_flops(rows, in_features * out_features, backward=backward, input_grad=input_grad)


def weight_flops(rows: float, num_weights: int, *, backward: bool = False, input_grad: bool = True) -> float:
    """``linear_flops`` for rows passing through ``num_weights`` weights (several linears at once)."""
    per_row = 2 * num_weights
    if backward:
        per_row += 4 * num_weights if input_grad else 2 * num_weights
    return float(rows) * per_row


def attention_flops(query_key_pairs: float, num_heads: int, head_dim: int, *, backward: bool = False) -> float:
    """Softmax attention FLOPs for ``query_key_pairs`` visible (query, key) pairs in one layer."""
    forward = 4.0 * num_heads * head_dim * query_key_pairs
    return forward * 3.0 if backward else forward


def linear_attention_flops(num_tokens: float, layer: LayerShape) -> float:
    """Forward FLOPs of a Gated DeltaNet's sequence mixing (conv + state update) over ``num_tokens``;
    its projections are counted with the layer's weights."""
    conv = 2 * layer.conv_kernel * layer.conv_channels
    state = 6 * layer.heads * layer.head_dim * layer.value_dim
    return float(num_tokens) * (conv + state)


def causal_pairs(length: int, window: int | None) -> int:
    """Visible (query, key) pairs of one causal document: query i sees min(i+1, window) keys."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def target_layer_flops(layer: LayerShape, lengths: Sequence[int]) -> float:
    """Forward FLOPs of one target layer over documents of ``lengths`` (packed or not)."""
    num_tokens = sum(lengths)
    total = weight_flops(num_tokens, layer.token_params)
    if layer.kind == LINEAR:
        return total + linear_attention_flops(num_tokens, layer)
    pairs = sum(causal_pairs(n, layer.window if layer.kind == SLIDING else None) for n in lengths)
    return total + attention_flops(pairs, layer.heads, layer.head_dim)


def target_flops(shape: DecoderShape, doc_lengths: Sequence[int] | torch.Tensor, num_layers_run: int) -> float:
    """Forward FLOPs of the target over one packed batch of documents.

    Counts the first ``num_layers_run`` layers (``max(target_layer_ids) + 1``), each by its kind:
    weights over every token, attention inside each document (causal; windowed in a sliding
    layer), linear attention's state update per token. No LM head, no cross-document work, no padding.
    """
    layers = shape.with_layers_run(num_layers_run).layers
    if isinstance(doc_lengths, torch.Tensor):
        doc_lengths = doc_lengths.tolist()  # a host copy; pass CPU tensors to avoid a device sync
    lengths = [int(n) for n in doc_lengths]
    return sum(target_layer_flops(layer, lengths) for layer in layers)


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------


def _drafter_pairs(anchor_positions: torch.Tensor, block_size: int, layer: LayerShape) -> float:
    """Visible (query, key) pairs of all blocks in one layer, as ``attention.dense_mask`` allows.

    Full layer: every slot sees the p context rows before its anchor and its whole block (visible
    keys = anchor position + block). Sliding layer: slot j sees slots 0..j of its block and the
    context rows within the window of its position p + j.
    """
    num_anchors = anchor_positions.numel()
    if layer.kind != SLIDING:
        return float(block_size * (anchor_positions.sum().item() + num_anchors * block_size))
    window = layer.window
    total = 0.0
    for slot in range(block_size):
        if window is None:
            context = anchor_positions
            own_block = slot + 1
        else:
            context = anchor_positions.clamp(max=max(0, window - slot - 1))
            own_block = min(slot + 1, window)
        total += float(context.sum().item()) + num_anchors * own_block
    return total


def drafter_flops_breakdown(
    shape: DrafterShape,
    *,
    num_context_rows: int,
    anchor_positions: Sequence[int] | torch.Tensor,
    num_labelled_rows: int,
    num_teacher_rows: int | None = None,
) -> dict[str, float]:
    """FLOPs of one drafter training pass (forward + backward), by part.

    ``num_context_rows``: target feature rows fed to ``fc`` (T, the batch's tokens).
    ``anchor_positions``: each anchor's position inside its document (N anchors; host values).
    ``num_labelled_rows``: block rows with a valid label (M <= N*(B-1)); only they reach the head.

    Parts, with which inputs need a gradient:

    - ``layers``: q, o, gate/up/down over the N*B query rows and k, v over the query rows, all with
      input gradients. Even in layer 0, whose residual input is the frozen embedding, every linear
      reads the output of a trained RMSNorm (``input_layernorm``, ``post_attention_layernorm``),
      so autograd computes the gradient of that input; later layers read trained activations.
    - ``context_kv``: k, v over the T context rows, with input gradients: their input C is the
      output of ``fc`` and ``hidden_norm``, which are trained.
    - ``fc``: K*H -> H over the T context rows, weight gradient only (its input, the target's
      features, is data).
    - ``attention``: forward ``4*heads*head_dim*visible_keys`` per query row, backward twice that;
      visible keys = anchor position + B in full-attention layers.
    - ``lm_head``: the frozen H -> V head over the M labelled rows: forward plus input gradient,
      ``4*H*V`` per row (no weight gradient). Unlabelled slots (slot 0, past the end of the
      document, prompt tokens) go through no head in a chunked loss and earn nothing.

    What the training method adds (``shape.method``; none for DFlash), per labelled row:

    - ``heads``: the method's trained head matmuls, forward and backward with input gradients (DSpark: the
      Markov projection r -> V, ``6*r*V``; the gated head's gate, ``6*(H+r)*r``; the confidence head,
      ``6*(H+r)`` or ``6*H``). DSpark's anchor slot drafts, so M <= N*B there.
    - ``teacher_head``: the frozen head on the target's final hidden state, forward only, ``2*H*V`` per distinct
      teacher row of each loss chunk (DSpark: the target's distribution, the L1 and confidence terms' reference;
      overlapping blocks share teacher rows, ``objective.dspark_blocks.distinct_teacher_rows``):
      ``num_teacher_rows``, counted from a pass's blocks (``drafter_flops_of_blocks``); when not given, estimated
      with the anchors as one document's, every slot labelled, scaled to ``num_labelled_rows``.
    """
    positions = torch.as_tensor(anchor_positions, dtype=torch.float64).flatten().cpu()
    if num_context_rows < 0 or num_labelled_rows < 0:
        raise ValueError("row counts must be non-negative")
    block = shape.block_size
    num_query_rows = positions.numel() * block
    if num_labelled_rows > positions.numel() * shape.drafted_slots:
        raise ValueError(
            f"num_labelled_rows={num_labelled_rows} exceeds anchors x drafted slots = "
            f"{positions.numel() * shape.drafted_slots}"
            + ("" if shape.method.drafts_anchor_slot else ": slot 0 of a block has no label")
        )
    hidden = shape.hidden_size
    parts = {
        "layers": sum(weight_flops(num_query_rows, layer.token_params, backward=True) for layer in shape.layers),
        "context_kv": sum(linear_flops(num_context_rows, hidden, layer.kv_width, backward=True)
                          for layer in shape.layers),
        "fc": linear_flops(num_context_rows, len(shape.target_layer_ids) * hidden, hidden, backward=True,
                           input_grad=False),
        "attention": sum(attention_flops(_drafter_pairs(positions, block, layer), layer.heads, layer.head_dim,
                                         backward=True) for layer in shape.layers),
        # Frozen head: forward 2*H*V plus the input gradient 2*H*V.
        "lm_head": linear_flops(num_labelled_rows, hidden, shape.vocab_size, backward=True, input_grad=False),
    }
    method = shape.method
    if method.row_params:
        parts["heads"] = weight_flops(num_labelled_rows, method.row_params, backward=True)
    if method.teacher_head:
        if num_teacher_rows is None:
            num_teacher_rows = estimated_teacher_rows(positions, block, num_labelled_rows, method.loss_chunk_rows)
        parts["teacher_head"] = linear_flops(num_teacher_rows, hidden, shape.vocab_size)
    return parts


def estimated_teacher_rows(anchor_positions: torch.Tensor, block_size: int, num_labelled_rows: int,
                           chunk_rows: int) -> int:
    """The distinct teacher rows of a pass's loss chunks, for anchors at ``anchor_positions`` of one document with
    every slot k reading the target at ``p + k``, scaled from all N x B slots to ``num_labelled_rows``."""
    slots = anchor_positions.numel() * block_size
    if slots == 0 or num_labelled_rows == 0:
        return 0
    rows = (anchor_positions.round().long()[:, None] + torch.arange(block_size)[None, :]).reshape(-1)
    distinct = distinct_teacher_rows(rows, chunk_rows if chunk_rows > 0 else slots).rows.numel()
    return round(distinct * num_labelled_rows / slots)


def drafter_flops(
    shape: DrafterShape,
    *,
    num_context_rows: int,
    anchor_positions: Sequence[int] | torch.Tensor,
    num_labelled_rows: int,
    num_teacher_rows: int | None = None,
) -> float:
    """Total FLOPs of one drafter training pass; see ``drafter_flops_breakdown`` for the parts."""
    parts = drafter_flops_breakdown(
        shape,
        num_context_rows=num_context_rows,
        anchor_positions=anchor_positions,
        num_labelled_rows=num_labelled_rows,
        num_teacher_rows=num_teacher_rows,
    )
    return sum(parts.values())


def drafter_flops_of_blocks(shape: DrafterShape, blocks: Any) -> float:
    """``drafter_flops`` of an ``objective.blocks.BlockBatch``; call it on the host copy.

    (On a device copy ``anchor_pos.sum()`` would synchronise with the GPU.)
    """
    return drafter_flops(
        shape,
        num_context_rows=blocks.layout.num_context,
        anchor_positions=blocks.layout.anchor_pos,
        num_labelled_rows=int(blocks.label_rows.shape[0]),
        num_teacher_rows=None if getattr(blocks, "teacher", None) is None else int(blocks.teacher.rows.shape[0]),
    )
