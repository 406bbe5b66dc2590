"""Who each block query may see: the DFlash visibility rule, as a dense mask and as a flex BlockMask.

Keys are laid out as ``[context rows (T) ; block rows (N * B)]``; query ``a * B + j`` is slot ``j``
of the block of anchor ``a``. The rule (docs/OBJECTIVE.md, "Visibility"):

- context row ``t`` is visible iff it is in the anchor's document and ``pos(t) < pos(anchor)``
  (strictly before the anchor: the anchor itself enters as slot 0 of the block);
- block row ``(a', i)`` is visible iff ``a' == a``: a block never sees another block;
- ``full_attention`` layers see their whole block (bidirectional); ``sliding_attention`` layers
  are causal inside the block (``i <= j``) and see only keys within ``sliding_window`` positions.

The dense path is exact and simple (CPU, tests, reference); the flex path builds a block-sparse
``BlockMask`` for ``torch.nn.attention.flex_attention`` on GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from draftline.errors import DraftlineError


@dataclass
class BlockLayout:
    """Where the anchors and context rows of one attention pass are."""

    context_doc: torch.Tensor  # [T] int: document id of each context row
    context_pos: torch.Tensor  # [T] int: position of each context row in its document
    anchor_doc: torch.Tensor  # [N] int
    anchor_pos: torch.Tensor  # [N] int: position of each anchor in its document
    block_size: int
    host: "BlockLayout | None" = field(default=None, repr=False, compare=False)
    """The host copy this layout was moved from: the tile structure is read from it, so building a
    flex mask does not wait for the device (a ``.cpu()`` of device tensors would)."""

    @property
    def num_context(self) -> int:
        return int(self.context_doc.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.anchor_doc.shape[0]) * self.block_size

    def block_positions(self) -> torch.Tensor:
        """Absolute positions of the block rows, [N * B]."""
        offsets = torch.arange(self.block_size, device=self.anchor_pos.device)
        return (self.anchor_pos[:, None] + offsets[None, :]).reshape(-1)

    def to(self, device: torch.device | str) -> "BlockLayout":
        host = self.host if self.host is not None else (self if self.context_doc.device.type == "cpu" else None)
        return BlockLayout(
            self.context_doc.to(device, non_blocking=True),
            self.context_pos.to(device, non_blocking=True),
            self.anchor_doc.to(device, non_blocking=True),
            self.anchor_pos.to(device, non_blocking=True),
            self.block_size,
            host,
        )

    def on_host(self) -> "BlockLayout":
        """This layout on the CPU: its host copy when it has one, else a copy (which syncs with the device)."""
        if self.host is not None:
            return self.host
        if self.context_doc.device.type == "cpu":
            return self
        return BlockLayout(*(t.cpu() for t in (self.context_doc, self.context_pos, self.anchor_doc, self.anchor_pos)),
                           self.block_size)


def dense_mask(layout: BlockLayout, *, sliding: bool, window: int | None) -> torch.Tensor:
    """Boolean visibility [Q, T + Q] (True = may attend)."""
    block = layout.block_size
    anchors = layout.anchor_doc.shape[0]
    device = layout.anchor_doc.device
    slot = torch.arange(block, device=device)
    q_anchor = torch.arange(anchors, device=device).repeat_interleave(block)  # [Q]
    q_slot = slot.repeat(anchors)  # [Q]
    q_pos = layout.anchor_pos[q_anchor] + q_slot

    same_doc = layout.anchor_doc[q_anchor, None] == layout.context_doc[None, :]
    ctx_visible = same_doc & (layout.context_pos[None, :] < layout.anchor_pos[q_anchor, None])
    blk_visible = q_anchor[:, None] == q_anchor[None, :]
    if sliding:
        blk_visible = blk_visible & (q_slot[None, :] <= q_slot[:, None])
        if window is not None:
            ctx_visible = ctx_visible & (q_pos[:, None] - layout.context_pos[None, :] < window)
            blk_visible = blk_visible & (q_slot[:, None] - q_slot[None, :] < window)
    return torch.cat([ctx_visible, blk_visible], dim=1)


class DenseAttention:
    """Exact attention with a materialised mask: O(Q * (T + Q)) memory. The reference path."""

    def __init__(self, layout: BlockLayout, layer_types: list[str], sliding_window: int | None, scale: float):
        self.scale = scale
        self.layer_types = layer_types
        masks: dict[str, torch.Tensor] = {}
        for kind in set(layer_types):
            masks[kind] = dense_mask(layout, sliding=kind == "sliding_attention", window=sliding_window)
        self.masks = masks

    def __call__(self, q, k, v, layer_idx):
        mask = self.masks[self.layer_types[layer_idx]]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None, None], scale=self.scale, enable_gqa=q.shape[1] != k.shape[1]
        )


TILE = 128  # flex_attention's tile size


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: a copy from pageable memory
    synchronises the stream (the host would wait for every kernel in flight); from pinned memory it
    is queued like a kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _tiles_to_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [q_tiles, kv_tiles] -> (num_blocks [1,1,Qt], indices [1,1,Qt,KVt]) for BlockMask."""
    num = tiles.sum(-1).to(torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None].contiguous(), order[None, None].contiguous()


def block_tiles(layout: BlockLayout, *, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Which 128x128 tiles of the [Q, T + Q] score matrix hold visible entries (partial, full).

    Built from the structure (anchors sorted by document and position), not by evaluating the
    mask: a query tile sees the context of its anchors' documents up to the latest anchor, and
    its own block rows. A tile is "full" when every query in it sees every key in it (no mask
    evaluation needed); sliding layers have no full tiles.
    """
    layout = layout.on_host()
    block = layout.block_size
    num_ctx = layout.num_context
    num_q = layout.num_queries
    q_tiles = -(-num_q // TILE)
    kv_tiles = -(-(num_ctx + num_q) // TILE)
    doc_start = torch.zeros(int(layout.context_doc.max()) + 2 if num_ctx else 1, dtype=torch.long)
    if num_ctx:
        # first token index of each document (documents are contiguous in the context rows)
        first = torch.ones(num_ctx, dtype=torch.bool)
        first[1:] = layout.context_doc[1:] != layout.context_doc[:-1]
        doc_start[layout.context_doc[first]] = torch.nonzero(first).flatten()
    anchors = layout.anchor_doc.shape[0]
    ctx_lo = doc_start[layout.anchor_doc]  # [N] first visible context row
    ctx_hi = ctx_lo + layout.anchor_pos  # [N] one past the last visible context row
    # Every query tile an anchor's rows fall in (two when block does not divide the tile).
    a = torch.arange(anchors)
    q_first = (a * block) // TILE
    q_last = (a * block + block - 1) // TILE
    diff = torch.zeros(q_tiles, kv_tiles + 1, dtype=torch.int32)
    has_ctx = ctx_hi > ctx_lo
    for q_tile in (q_first, q_last):
        rows = q_tile[has_ctx]
        diff.index_put_((rows, ctx_lo[has_ctx] // TILE), torch.ones(rows.shape[0], dtype=torch.int32), accumulate=True)
        diff.index_put_((rows, (ctx_hi[has_ctx] - 1) // TILE + 1), -torch.ones(rows.shape[0], dtype=torch.int32),
                        accumulate=True)
        blk_lo = (num_ctx + a * block) // TILE
        blk_hi = (num_ctx + a * block + block - 1) // TILE
        diff.index_put_((q_tile, blk_lo), torch.ones(anchors, dtype=torch.int32), accumulate=True)
        diff.index_put_((q_tile, blk_hi + 1), -torch.ones(anchors, dtype=torch.int32), accumulate=True)
    touched = diff.cumsum(-1)[:, :kv_tiles] > 0
    full = torch.zeros_like(touched)
    if not sliding and anchors:
        # A query tile's rows belong to the anchors whose blocks intersect it (q_first..q_last).
        # Its whole context tiles need no mask when all those anchors share a document: from the
        # latest document start to the earliest anchor position, in whole tiles.
        big = torch.iinfo(torch.long).max
        lo_max = torch.full((q_tiles,), -1, dtype=torch.long)
        hi_min = torch.full((q_tiles,), big, dtype=torch.long)
        doc_min = torch.full((q_tiles,), big, dtype=torch.long)
        doc_max = torch.full((q_tiles,), -1, dtype=torch.long)
        anchor_doc = layout.anchor_doc.long()
        for q_tile in (q_first, q_last):
            lo_max.scatter_reduce_(0, q_tile, ctx_lo, "amax")
            hi_min.scatter_reduce_(0, q_tile, ctx_hi, "amin")
            doc_min.scatter_reduce_(0, q_tile, anchor_doc, "amin")
            doc_max.scatter_reduce_(0, q_tile, anchor_doc, "amax")
        one_doc = (doc_min == doc_max) & (lo_max >= 0)
        start = -(-lo_max.clamp(min=0) // TILE)
        stop = hi_min.clamp(max=kv_tiles * TILE) // TILE
        kv = torch.arange(kv_tiles)[None, :]
        full = one_doc[:, None] & (kv >= start[:, None]) & (kv < stop[:, None])
    return touched & ~full, full


def document_causal_block_mask(doc_lengths: torch.Tensor, device: torch.device):
    """A flex ``BlockMask`` for causal attention within each packed document (the target's pass)."""
    from torch.nn.attention.flex_attention import BlockMask

    lengths = doc_lengths.cpu().long()
    total = int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    start_of_token = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    tiles = -(-total // TILE)
    rows = torch.arange(tiles)
    first_row = rows * TILE
    last_row = torch.clamp(first_row + TILE - 1, max=total - 1)
    lo = start_of_token[first_row] // TILE  # earliest key tile any row of the tile sees
    full_lo = -(-start_of_token[last_row] // TILE)  # from here every row sees whole tiles ...
    kv = torch.arange(tiles)[None, :]
    touched = (kv >= lo[:, None]) & (kv <= rows[:, None])
    full = (kv >= full_lo[:, None]) & (kv < rows[:, None])  # ... strictly below the diagonal tile
    partial = touched & ~full
    doc_dev = _to_device(doc, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_dev[q_idx] == doc_dev[kv_idx]) & (kv_idx <= q_idx)

    num, idx = _tiles_to_indices(partial)
    full_num, full_idx = _tiles_to_indices(full)
    return BlockMask.from_kv_blocks(*(_to_device(t, device) for t in (num, idx, full_num, full_idx)),
                                    BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(total, total))


def key_query_tables(layout: BlockLayout) -> dict[str, torch.Tensor]:
    """Per-key and per-query int32 tables from which the visibility rule reads (flex's mask_mod).

    Keys ``[context ; block rows]``: ``kv_doc`` (context rows: their document, block rows: -1, which
    no query has), ``kv_pos`` (position in the document; a block row ``(a', i)`` is at
    ``pos(a') + i``), ``kv_anchor`` (block rows: their anchor ``a'``, context rows: -1). Queries
    ``(a, j)``: ``q_doc``, ``q_anchor`` (``a``), ``q_anchor_pos`` (``pos(a)``), ``q_pos``
    (``pos(a) + j``). The rule is then comparisons of gathered values only, with no integer
    constant of the layout inside the mask function: its compiled kernel serves every pass shape,
    and FlashAttention-4's backend (which cannot take symbolic scalars) can compile it.
    """
    block = layout.block_size
    anchors = layout.anchor_doc.shape[0]
    device = layout.anchor_doc.device
    i32 = torch.int32
    q_anchor = torch.arange(anchors, device=device, dtype=i32).repeat_interleave(block)
    q_anchor_pos = layout.anchor_pos.to(i32).repeat_interleave(block)
    q_pos = layout.block_positions().to(i32)
    return {
        "kv_doc": torch.cat([layout.context_doc.to(i32), torch.full_like(q_anchor, -1)]),
        "kv_pos": torch.cat([layout.context_pos.to(i32), q_pos]),
        "kv_anchor": torch.cat([torch.full((layout.num_context,), -1, device=device, dtype=i32), q_anchor]),
        "q_doc": layout.anchor_doc.to(i32).repeat_interleave(block),
        "q_anchor": q_anchor,
        "q_anchor_pos": q_anchor_pos,
        "q_pos": q_pos,
    }


FLEX_KERNELS = {"flex": None, "flash": {"BACKEND": "FLASH"}}
"""flex_attention's kernel options per backend: 'flex' its Triton kernels, 'flash' FlashAttention-4's
CuTe DSL kernels (the ``flash-attn-4`` package; Hopper and Blackwell GPUs)."""


class FlexAttention:
    """Block-sparse attention through ``flex_attention``: only visible 128x128 tiles are computed."""

    def __init__(self, layout: BlockLayout, layer_types: list[str], sliding_window: int | None, scale: float,
                 kernel: str = "flex"):
        from torch.nn.attention.flex_attention import BlockMask

        self.scale = scale
        self.layer_types = layer_types
        self.kernel_options = FLEX_KERNELS[kernel]
        # Compiled kernels on GPU; on CPU the eager flex path is a slow but exact cross-check.
        self.compiled = layout.context_doc.is_cuda
        tables = key_query_tables(layout)
        kv_doc, kv_pos, kv_anchor = tables["kv_doc"], tables["kv_pos"], tables["kv_anchor"]
        q_doc, q_anchor, q_anchor_pos, q_pos = (tables[k] for k in ("q_doc", "q_anchor", "q_anchor_pos", "q_pos"))
        total_kv = layout.num_context + layout.num_queries
        windowed = sliding_window is not None
        q_low = q_pos - sliding_window if windowed else q_pos  # keys at or before q_low are out of the window

        def make(sliding: bool):
            def mask_mod(b, h, q_idx, kv_idx):
                # context rows: same document, strictly before the anchor; block rows: the query's own block
                ctx_ok = (kv_doc[kv_idx] == q_doc[q_idx]) & (kv_pos[kv_idx] < q_anchor_pos[q_idx])
                blk_ok = kv_anchor[kv_idx] == q_anchor[q_idx]
                if sliding:
                    blk_ok = blk_ok & (kv_pos[kv_idx] <= q_pos[q_idx])  # causal inside the block
                    if windowed:
                        inside = kv_pos[kv_idx] > q_low[q_idx]
                        ctx_ok, blk_ok = ctx_ok & inside, blk_ok & inside
                return ctx_ok | blk_ok

            partial, full = block_tiles(layout, sliding=sliding)
            device = layout.context_doc.device
            num, idx = _tiles_to_indices(partial)
            full_num, full_idx = _tiles_to_indices(full)
            return BlockMask.from_kv_blocks(
                *(_to_device(t, device) for t in (num, idx, full_num, full_idx)),
                BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(layout.num_queries, total_kv),
            )

        self.block_masks = {kind: make(kind == "sliding_attention") for kind in set(layer_types)}

    def __call__(self, q, k, v, layer_idx):
        from torch.nn.attention.flex_attention import flex_attention

        mask = self.block_masks[self.layer_types[layer_idx]]
        kernel = _compiled_flex() if self.compiled else flex_attention
        with flex_compile_shapes(self.kernel_options):
            return kernel(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=self.kernel_options)


def flex_compile_shapes(kernel_options):
    """How dynamic shapes are named while flex compiles for ``kernel_options``.

    With duck shaping (torch's default) the per-query tables share the size symbol of the queries and
    the per-key tables that of the keys; Inductor then passes that symbol into the mask function as a
    scalar, which FlashAttention-4's backend refuses ("mask_mod captures a dynamic scalar"). For that
    backend each size gets its own symbol; the Triton kernels keep torch's default.
    """
    if not kernel_options or kernel_options.get("BACKEND") != "FLASH":
        return contextlib.nullcontext()
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(use_duck_shape=False)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


FLASH_HEAD_DIMS = (64, 128)
"""Head sizes the FlashAttention-4 path is tested with (tests/model/test_gpu.py); others use flex."""

FLASH_INSTALL = "pip install 'draftline[flash]' (flash-attn-4; on CUDA 13 'flash-attn-4[cu13]')"


def flash_unavailable(device: torch.device, head_dim: int) -> str | None:
    """Why FlashAttention-4's kernels cannot run this drafter's attention here; None when they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the drafter runs on {device.type}, not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.{minor}: FlashAttention-4 runs on Hopper (9.0) and Blackwell (10.x)"
    if head_dim not in FLASH_HEAD_DIMS:
        return f"head_dim {head_dim} (the FlashAttention-4 path is used for {', '.join(map(str, FLASH_HEAD_DIMS))})"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"flash-attn-4 is not installed: {FLASH_INSTALL}"
    return None


def probe_flash(device: torch.device, config) -> str | None:
    """One small forward and backward through the FLASH backend, against dense attention in fp32.

    Returns why it failed (a lowering error, or outputs/gradients off by more than bf16 rounding
    allows), None when it passed. Its compiled kernels serve the real passes after it."""
    generator = torch.Generator(device=device).manual_seed(0)  # the run's own random state stays untouched
    blocks, block = 16, 16
    layout = BlockLayout(torch.zeros(512, dtype=torch.long), torch.arange(512), torch.zeros(blocks, dtype=torch.long),
                         torch.arange(blocks) * 31 + 7, block).to(device)
    types = sorted(set(config.layer_types))
    window = config.sliding_window if "sliding_attention" in types else None
    scale = config.head_dim**-0.5
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    rows, keys = layout.num_queries, layout.num_context + layout.num_queries
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            flash = FlexAttention(layout, types, window, scale, kernel="flash")
            dense = DenseAttention(layout, types, window, scale)
            for layer in range(len(types)):
                inputs = [torch.randn(1, h, n, config.head_dim, device=device, generator=generator)
                          .to(torch.bfloat16).requires_grad_(True)
                          for h, n in ((heads, rows), (kv_heads, keys), (kv_heads, keys))]
                out = flash(*inputs, layer)
                out.float().square().sum().backward()
                mine = [out.detach().float()] + [t.grad.float() for t in inputs]
                ref_in = [t.detach().float().requires_grad_(True) for t in inputs]
                ref_out = dense(*ref_in, layer)
                ref_out.square().sum().backward()
                for name, a, b in zip(("output", "dq", "dk", "dv"), mine, [ref_out.detach()] + [t.grad for t in ref_in]):
                    err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
                    if not err < 3e-2:
                        return f"{types[layer]} {name} differs from dense attention by {err:.3g} (norm-relative)"
    except Exception as exc:  # noqa: BLE001 - any failure of an optional kernel means: use the default one
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return None


_AUTO: dict[tuple, str] = {}


def auto_backend(device: torch.device, config) -> str:
    """'auto': FlashAttention-4's kernels where they are installed, supported and pass ``probe_flash``;
    else flex's Triton kernels on GPU and the dense mask on CPU. Decided once per device and shape."""
    device = torch.device(device)
    if device.type != "cuda":
        return "dense"
    key = (str(device), config.head_dim, config.num_attention_heads, config.num_key_value_heads,
           tuple(sorted(set(config.layer_types))), getattr(config, "sliding_window", None))
    if key not in _AUTO:
        reason = flash_unavailable(device, config.head_dim)
        if reason is None and (failed := probe_flash(device, config)) is not None:
            warnings.warn(f"FlashAttention-4's kernels failed a first check ({failed}); the drafter's attention "
                          "uses flex's Triton kernels instead (--attention flash raises the error itself)",
                          stacklevel=2)
            _AUTO[key] = "flex"
            return "flex"
        _AUTO[key] = "flash" if reason is None else "flex"
        print("draftline: drafter attention on " + ("FlashAttention-4's kernels (flash-attn-4)" if reason is None else
                                                    f"flex's Triton kernels (FlashAttention-4 not used: {reason})"),
              flush=True)
    return _AUTO[key]


def make_attention(layout: BlockLayout, config, backend: str = "auto"):
    """The attention for ``layout`` with ``config``'s layer types: 'dense', 'flex', 'flash' or 'auto'."""
    layer_types = list(config.layer_types)
    window = config.sliding_window if "sliding_attention" in layer_types else None
    scale = config.head_dim**-0.5
    if backend == "auto":
        backend = auto_backend(layout.context_doc.device, config)  # decided once: no checks per pass
    elif backend == "flash" and (reason := flash_unavailable(layout.context_doc.device, config.head_dim)):
        raise DraftlineError(f"engine.attention 'flash' (--attention flash) cannot run here: {reason}; "
                             "use --attention auto or flex")
    if backend == "dense":
        return DenseAttention(layout, layer_types, window, scale)
    if backend in FLEX_KERNELS:
        return FlexAttention(layout, layer_types, window, scale, kernel=backend)
    raise ValueError(f"unknown attention backend {backend!r}; use 'auto', 'dense', 'flex' or 'flash'")
