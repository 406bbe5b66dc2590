"""Model FLOPs, the project's one counter (docs/PERF.md), and MFU.

The convention, as the functions below apply it:

- Linear layer, one row: forward ``2*in*out``; backward ``4*in*out`` when its input needs a
  gradient (input gradient + weight gradient), ``2*in*out`` (weight gradient only) when it does
  not. A frozen linear costs its forward, plus ``2*in*out`` if a gradient flows through it.
- Attention, one query row, one layer: forward ``4*heads*head_dim*visible_keys`` (QK^T and PV);
  backward twice that.
- Target: forward only, only the layers that must run (up to the deepest feature layer), causal
  attention within each document, no LM head. Extra work earns no credit.
- Drafter: one training pass (forward + backward); see ``drafter_flops_breakdown``.

Only model FLOPs count: norms, RoPE, softmax, the loss, padding and masked-out keys earn nothing,
so MFU is comparable across implementations (flex vs dense attention, chunked heads, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from draftline.model.config import text_config

# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


def _sliding_flags(config: Any, num_layers: int) -> tuple[bool, ...]:
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != num_layers:
        return (False,) * num_layers
    return tuple(t == "sliding_attention" for t in layer_types)


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a dense decoder-only target that its FLOPs depend on."""

    hidden_size: int
    """Width of the residual stream, H."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA)."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """MLP width per token (for MoE targets: the active experts' width, see ``from_config``)."""
    num_layers: int
    """Decoder layers of the whole model (the target only runs some of them)."""
    vocab_size: int
    """Rows of the LM head (never counted for the target; kept for reference)."""
    sliding: tuple[bool, ...] = ()
    """Per layer: True for a sliding-window attention layer; empty means all full attention."""
    sliding_window: int | None = None
    """Window of the sliding layers, in positions."""

    @classmethod
    def from_config(cls, config: Any) -> "TargetShape":
        """From a Hugging Face target config (multimodal configs: their text part).

        MoE configs (``num_experts_per_tok`` + ``moe_intermediate_size``) count the routed experts
        each token runs plus any shared expert; the router is ignored. Linear-attention (hybrid)
        layers are counted as softmax attention, which over-counts them.
        """
        text = text_config(config)
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        intermediate = int(getattr(text, "intermediate_size", None) or 0)
        experts_per_token = getattr(text, "num_experts_per_tok", None)
        moe_size = getattr(text, "moe_intermediate_size", None)
        if experts_per_token and moe_size:
            intermediate = int(experts_per_token) * int(moe_size)
            intermediate += int(getattr(text, "shared_expert_intermediate_size", None) or 0)
        layers = int(text.num_hidden_layers)
        sliding = _sliding_flags(text, layers)
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            num_layers=layers,
            vocab_size=int(text.vocab_size),
            sliding=sliding if any(sliding) else (),
            sliding_window=getattr(text, "sliding_window", None) if any(sliding) else None,
        )

    def linear_params_per_layer(self) -> int:
        """Weights a token's row passes through in one layer: q, k, v, o and the SwiGLU MLP."""
        return _layer_linear_params(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                                    self.intermediate_size)


@dataclass(frozen=True)
class DrafterShape:
    """The sizes of a DFlash drafter that its training FLOPs depend on."""

    hidden_size: int
    """H: equals the target's (shared embedding and LM head)."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """SwiGLU MLP width."""
    num_layers: int
    """Drafter decoder layers (5 by default)."""
    vocab_size: int
    """Rows of the target's LM head, used frozen on the labelled rows."""
    target_layer_ids: tuple[int, ...]
    """Target layers feeding ``fc`` (K = their number; ``fc`` is K*H -> H)."""
    block_size: int = 16
    """B: rows per anchor block (anchor + B-1 masks)."""
    sliding: tuple[bool, ...] = ()
    """Per layer: True for a sliding-window layer (causal in the block, window on keys)."""
    sliding_window: int | None = None
    """Window of the sliding layers, in positions."""
    teacher_layers: int = 0
    """Target layers run for soft labels (``--distill``: all of them); 0 = features only."""

    @classmethod
    def from_config(cls, config: Any) -> "DrafterShape":
        """From the drafter's Qwen3Config (``dflash_config.target_layer_ids``, ``block_size``)."""
        layers = int(config.num_hidden_layers)
        sliding = _sliding_flags(config, layers)
        heads = int(config.num_attention_heads)
        return cls(
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            num_layers=layers,
            vocab_size=int(config.vocab_size),
            target_layer_ids=tuple(int(i) for i in config.dflash_config["target_layer_ids"]),
            block_size=int(getattr(config, "block_size", 16)),
            sliding=sliding if any(sliding) else (),
            sliding_window=getattr(config, "sliding_window", None) if any(sliding) else None,
        )

    @property
    def target_layers_run(self) -> int:
        """How many target layers must run to produce this drafter's features (and soft labels)."""
        return max(max(self.target_layer_ids) + 1, self.teacher_layers)


def _layer_linear_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    q_and_o = 2 * hidden * heads * head_dim
    k_and_v = 2 * hidden * kv_heads * head_dim
    return q_and_o + k_and_v + 3 * hidden * intermediate


def linear_flops(rows: float, in_features: int, out_features: int, *, backward: bool = False,
                 input_grad: bool = True) -> float:
    """FLOPs of ``rows`` rows through one linear: forward, plus backward when ``backward``.

    Backward is ``4*in*out`` per row with ``input_grad`` (input and weight gradients), else
    ``2*in*out`` (only the weight gradient, or only the input gradient of a frozen linear).
    """
    return _weight_flops(rows, in_features * out_features, backward=backward, input_grad=input_grad)


def _weight_flops(rows: float, num_weights: int, *, backward: bool = False, input_grad: bool = True) -> float:
    """``linear_flops`` for rows passing through ``num_weights`` weights (several linears at once)."""
    per_row = 2 * num_weights
    if backward:
        per_row += 4 * num_weights if input_grad else 2 * num_weights
    return float(rows) * per_row


def attention_flops(query_key_pairs: float, num_heads: int, head_dim: int, *, backward: bool = False) -> float:
    """Attention FLOPs for ``query_key_pairs`` visible (query, key) pairs in one layer."""
    forward = 4.0 * num_heads * head_dim * query_key_pairs
    return forward * 3.0 if backward else forward


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def _causal_pairs(length: int, window: int | None) -> int:
    """Visible (query, key) pairs of one causal document: query i sees min(i+1, window) keys."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def target_flops(shape: TargetShape, doc_lengths: Sequence[int] | torch.Tensor, num_layers_run: int) -> float:
    """Forward FLOPs of the target over one packed batch of documents.

    Counts ``num_layers_run`` layers (``max(target_layer_ids) + 1``): q/k/v/o and MLP over every
    token, and causal attention inside each document (query i sees i+1 keys, or the window in a
    sliding layer). No LM head, no cross-document attention, no padding.
    """
    if not 1 <= num_layers_run <= shape.num_layers:
        raise ValueError(f"num_layers_run={num_layers_run} must lie in [1, {shape.num_layers}] (the target's layers)")
    if isinstance(doc_lengths, torch.Tensor):
        doc_lengths = doc_lengths.tolist()  # a host copy; pass CPU tensors to avoid a device sync
    lengths = [int(n) for n in doc_lengths]
    num_tokens = sum(lengths)
    total = num_layers_run * _weight_flops(num_tokens, shape.linear_params_per_layer())
    for layer in range(num_layers_run):
        window = shape.sliding_window if shape.sliding and shape.sliding[layer] else None
        pairs = sum(_causal_pairs(n, window) for n in lengths)
        total += attention_flops(pairs, shape.num_heads, shape.head_dim)
    return total


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------


def _drafter_pairs(anchor_positions: torch.Tensor, block_size: int, window: int | None, sliding: bool) -> float:
    """Visible (query, key) pairs of all blocks in one layer, as ``attention.dense_mask`` allows.

    Full layer: every slot sees the p context rows before its anchor and its whole block
    (PERF.md: visible keys = anchor position + block). Sliding layer: slot j sees slots 0..j of its
    block and the context rows within the window of its position p + j.
    """
    num_anchors = anchor_positions.numel()
    if not sliding:
        return float(block_size * (anchor_positions.sum().item() + num_anchors * block_size))
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
    """
    positions = torch.as_tensor(anchor_positions, dtype=torch.float64).flatten().cpu()
    if num_context_rows < 0 or num_labelled_rows < 0:
        raise ValueError("row counts must be non-negative")
    block = shape.block_size
    num_query_rows = positions.numel() * block
    if num_labelled_rows > positions.numel() * (block - 1):
        raise ValueError(
            f"num_labelled_rows={num_labelled_rows} exceeds anchors x (block_size - 1) = "
            f"{positions.numel() * (block - 1)}: slot 0 of a block has no label"
        )
    hidden = shape.hidden_size
    kv_out = shape.num_kv_heads * shape.head_dim
    query_params = _layer_linear_params(hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                        shape.intermediate_size)

    parts = {
        "layers": shape.num_layers * _weight_flops(num_query_rows, query_params, backward=True),
        "context_kv": shape.num_layers * linear_flops(num_context_rows, hidden, 2 * kv_out, backward=True),
        "fc": linear_flops(num_context_rows, len(shape.target_layer_ids) * hidden, hidden, backward=True,
                           input_grad=False),
        "attention": 0.0,
        # Frozen head: forward 2*H*V plus the input gradient 2*H*V.
        "lm_head": linear_flops(num_labelled_rows, hidden, shape.vocab_size, backward=True, input_grad=False),
    }
    for layer in range(shape.num_layers):
        sliding = bool(shape.sliding and shape.sliding[layer])
        pairs = _drafter_pairs(positions, block, shape.sliding_window, sliding)
        parts["attention"] += attention_flops(pairs, shape.num_heads, shape.head_dim, backward=True)
    return parts


def drafter_flops(
    shape: DrafterShape,
    *,
    num_context_rows: int,
    anchor_positions: Sequence[int] | torch.Tensor,
    num_labelled_rows: int,
) -> float:
    """Total FLOPs of one drafter training pass; see ``drafter_flops_breakdown`` for the parts."""
    parts = drafter_flops_breakdown(
        shape,
        num_context_rows=num_context_rows,
        anchor_positions=anchor_positions,
        num_labelled_rows=num_labelled_rows,
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
    )


# ---------------------------------------------------------------------------------------------
# The reference workload of docs/PERF.md: one mean-length document per sample
# ---------------------------------------------------------------------------------------------


def reference_target_flops(shape: TargetShape, num_layers_run: int, mean_length: int = 2826) -> float:
    """Target FLOPs of one sample of the PERF.md reference workload (one document)."""
    return target_flops(shape, [mean_length], num_layers_run)


def reference_drafter_flops(
    shape: DrafterShape,
    mean_length: int = 2826,
    num_anchors: int = 512,
    prompt_length: int = 0,
) -> float:
    """Drafter FLOPs of one sample of the PERF.md reference workload.

    The table's figures follow from: one document of ``mean_length`` tokens, all of them context
    rows; anchors spread evenly over positions ``prompt_length .. mean_length - 1`` (the table
    uses 0: mean position (L-1)/2); every non-anchor slot labelled (N x (B-1) rows).
    """
    if not 0 < num_anchors <= mean_length - prompt_length:
        raise ValueError(f"{num_anchors} anchors do not fit in {mean_length - prompt_length} response positions")
    positions = torch.linspace(prompt_length, mean_length - 1, num_anchors, dtype=torch.float64)
    return drafter_flops(
        shape,
        num_context_rows=mean_length,
        anchor_positions=positions,
        num_labelled_rows=num_anchors * (shape.block_size - 1),
    )


# ---------------------------------------------------------------------------------------------
# MFU and the peak it is measured against
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakFlops:
    """The dense matrix rate MFU is relative to, and where that number came from."""

    flops: float
    """FLOP/s of one device."""
    source: str
    """Why this number: known table entry, measured here, or given by the user."""

    def describe(self) -> str:
        return f"peak {format_flops(self.flops)}/s per device ({self.source})"


def format_flops(flops: float) -> str:
    """``788e12`` -> ``"788 TFLOP"``; small numbers in GFLOP so a CPU run reads sensibly."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP"


# Peaks measured with ``measure_peak_flops``'s method on real machines. Keyed by the exact
# torch device name: variants with other clocks or power limits (e.g. "NVIDIA H200 NVL") differ.
_KNOWN_PEAKS = {
    "nvidia h200": PeakFlops(788e12, "known: development H200, 8192^3 bf16 matmul, torch 2.11"),
}


def known_peak(device_name: str) -> PeakFlops | None:
    """The measured peak of a known device by its torch name, or None."""
    return _KNOWN_PEAKS.get(device_name.strip().lower())


def mfu(flops: float, seconds: float, peak_flops: float, num_gpus: int = 1) -> float:
    """Model-FLOP utilisation: counted FLOPs / (wall seconds x peak x GPUs); NaN before any time."""
    if peak_flops <= 0 or num_gpus < 1:
        raise ValueError(f"peak_flops must be positive and num_gpus >= 1, got {peak_flops} and {num_gpus}")
    if seconds <= 0:
        return float("nan")
    return flops / (seconds * peak_flops * num_gpus)


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype | None = None) -> float:
    """Dense matrix-multiply FLOP/s of ``device``.

    CUDA: 8192^3 products in ``dtype`` (bf16 by default), 3 warm-ups, then the median of 5 windows
    of 10 products timed with CUDA events (about a second on an H200). CPU: 512^3 fp32 products
    for about 0.2 s, enough for an order of magnitude, which is all a CPU run needs.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(device, dtype or torch.bfloat16)
    return _measure_cpu(dtype or torch.float32)


def _measure_cuda(device: torch.device, dtype: torch.dtype, size: int = 8192) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    with torch.cuda.device(device):
        for _ in range(3):  # clocks ramp up and cuBLAS picks its kernel here
            torch.mm(a, b, out=out)
        rates = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            rates.append(10 * 2 * size**3 / (start.elapsed_time(end) / 1e3))
    return sorted(rates)[len(rates) // 2]


def _measure_cpu(dtype: torch.dtype, size: int = 512, budget_s: float = 0.3) -> float:
    """The best of several short windows: a busy machine slows some windows, never speeds one up."""
    import time

    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool start
    best, deadline = 0.0, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def resolve_peak(device: torch.device | str, dtype: torch.dtype | None = None,
                 override_flops: float | None = None) -> PeakFlops:
    """The peak the monitor uses: the user's number, else a known device's, else measured here."""
    if override_flops is not None:
        if override_flops <= 0:
            raise ValueError(f"the peak must be positive FLOP/s, got {override_flops}")
        return PeakFlops(float(override_flops), "given by the user")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = known_peak(name)
        if known is not None:
            return known
        dtype = dtype or torch.bfloat16
        return PeakFlops(_measure_cuda(device, dtype), f"measured here: {name}, 8192^3 {_dtype_name(dtype)} matmul")
    dtype = dtype or torch.float32
    return PeakFlops(_measure_cpu(dtype), f"measured here: CPU, 512^3 {_dtype_name(dtype)} matmul")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
