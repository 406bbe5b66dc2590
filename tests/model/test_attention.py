"""The DFlash visibility rule: what a block may and may not see."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model.attention import DenseAttention, FlexAttention, dense_mask
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.objective.blocks import build_blocks
from helpers import layout_for


def test_full_attention_mask_rule():
    layout = layout_for([6, 5], [[0, 3], [2]], block=3)
    mask = dense_mask(layout, sliding=False, window=None)
    T = 11
    # anchor 1 (doc 0, pos 3): sees doc-0 positions 0,1,2 only, and its own whole block.
    rows = mask[3:6]
    assert rows[:, :T].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]] * 3
    assert rows[:, T:].int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3  # bidirectional, own block only
    # anchor 0 at position 0 sees no context at all.
    assert not mask[0:3, :T].any()
    # anchor 2 (doc 1, pos 2) sees doc-1 positions 0 and 1 (token indices 6, 7), nothing of doc 0.
    assert mask[6:9, :T].nonzero()[:, 1].unique().tolist() == [6, 7]


def test_sliding_attention_mask_is_causal_in_block_and_windowed():
    layout = layout_for([10], [[6]], block=4)
    mask = dense_mask(layout, sliding=True, window=3)
    T = 10
    for j in range(4):
        q_pos = 6 + j
        ctx = mask[j, :T].nonzero().flatten().tolist()
        assert ctx == [t for t in range(6) if q_pos - t < 3]
        blk = mask[j, T:].nonzero().flatten().tolist()
        assert blk == [i for i in range(4) if i <= j and j - i < 3]


def test_flex_path_equals_dense_path():
    torch.manual_seed(0)
    layout = layout_for([9, 13, 4], [[1, 5, 7], [0, 4, 11], [2]], block=4)
    q_rows = layout.num_queries
    kv = layout.num_context + q_rows
    q = torch.randn(1, 4, q_rows, 8)
    k = torch.randn(1, 2, kv, 8)
    v = torch.randn(1, 2, kv, 8)
    types = ["full_attention", "sliding_attention"]
    dense = DenseAttention(layout, types, 5, 8**-0.5)
    flex = FlexAttention(layout, types, 5, 8**-0.5)
    for layer in range(2):
        torch.testing.assert_close(flex(q, k, v, layer), dense(q, k, v, layer), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "layer_types",
    [["full_attention"] * 2, ["sliding_attention", "full_attention"], ["sliding_attention"] * 2],
)
def test_blocks_do_not_see_later_context_other_blocks_or_documents(qwen3_target, layer_types):
    """Perturbing what a block must not see leaves its output unchanged; what it sees changes it."""
    config = build_drafter_config(
        load_target_config(qwen3_target), num_hidden_layers=2, block_size=4, layer_types=layer_types, sliding_window=6
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float()
    drafter.reset_parameters(std=0.2)
    docs = [(list(range(1, 13)), [True] * 12), (list(range(20, 30)), [True] * 10)]
    batch = PackedBatch.from_documents(docs)
    anchors = torch.tensor([3, 7, 12 + 5])  # doc 0 at 3 and 7, doc 1 at 5
    blocks = build_blocks(batch, anchors, block_size=4, mask_token_id=0, gamma=4.0)
    H = config.hidden_size
    feats = torch.randn(batch.num_tokens, len(drafter.target_layer_ids) * H)
    embeds = torch.randn(blocks.block_input_ids.shape[0], H)

    def run(f, e):
        attend = DenseAttention(blocks.layout, layer_types, 6, config.head_dim**-0.5)
        with torch.no_grad():
            return drafter(e, f, blocks.block_positions, blocks.context_positions, attend)

    base = run(feats, embeds)
    # Context at or after anchor 0's position (index 3..11), and all of doc 1: invisible to block 0.
    f2 = feats.clone()
    f2[3:] += torch.randn_like(f2[3:])
    torch.testing.assert_close(run(f2, embeds)[0:4], base[0:4])
    assert not torch.allclose(run(f2, embeds)[4:8], base[4:8])  # block 1 (anchor 7) sees positions 3..6
    # Another block's inputs: invisible.
    e2 = embeds.clone()
    e2[4:12] += torch.randn_like(e2[4:12])
    torch.testing.assert_close(run(feats, e2)[0:4], base[0:4])
    # Doc 0 is invisible to doc 1's block (anchor at doc-1 position 5).
    f3 = feats.clone()
    f3[:12] += torch.randn_like(f3[:12])
    torch.testing.assert_close(run(f3, embeds)[8:12], base[8:12])
    # Full attention is bidirectional inside the block (the last slot reaches slot 0); sliding
    # layers are causal, so with only sliding layers it cannot.
    e3 = embeds.clone()
    e3[3] += torch.randn_like(e3[3])
    changed = not torch.allclose(run(feats, e3)[0], base[0])
    assert changed == ("full_attention" in layer_types)


@pytest.mark.parametrize("block", [4, 16, 10])
@pytest.mark.parametrize("sliding", [False, True])
def test_structured_tiles_cover_every_visible_entry(block, sliding):
    """The tiles built from the structure: every visible entry is in a computed tile, full tiles are all visible."""
    from draftline.model.attention import TILE, block_tiles

    g = torch.Generator().manual_seed(block)
    lengths = [300, 41, 700, 129]
    anchors = [sorted(torch.randperm(n - 1, generator=g)[: min(n - 1, 23)].tolist()) for n in lengths]
    layout = layout_for(lengths, anchors, block)
    mask = dense_mask(layout, sliding=sliding, window=50 if sliding else None)
    partial, full = block_tiles(layout, sliding=sliding)
    q, kv = mask.shape
    padded = torch.zeros(partial.shape[0] * TILE, partial.shape[1] * TILE, dtype=torch.bool)
    padded[:q, :kv] = mask
    per_tile = padded.view(partial.shape[0], TILE, partial.shape[1], TILE)
    any_visible = per_tile.any(dim=(1, 3))
    assert not (any_visible & ~(partial | full)).any()  # nothing visible is skipped
    assert not (partial & full).any()
    rows_valid = torch.zeros(partial.shape[0] * TILE, dtype=torch.bool)
    rows_valid[:q] = True
    valid = rows_valid.view(-1, TILE)
    for qt, kt in full.nonzero().tolist():
        tile = per_tile[qt, :, kt, :][valid[qt]]
        assert tile.all()  # a full tile needs no mask
    if sliding:
        assert not full.any()  # the window is checked everywhere
    elif block == 16:
        assert full.any()  # 8 anchors of one document share a tile: whole context tiles need no mask
    if not sliding:  # and no tile is computed for nothing
        assert torch.equal(partial | full, any_visible)


def test_structured_flex_mask_equals_dense_attention():
    torch.manual_seed(1)
    lengths = [200, 150]
    anchors = [list(range(3, 190, 7)), list(range(0, 140, 5))]
    layout = layout_for(lengths, anchors, 16)
    q = torch.randn(1, 2, layout.num_queries, 8)
    k = torch.randn(1, 1, layout.num_context + layout.num_queries, 8)
    v = torch.randn_like(k)
    types = ["full_attention", "sliding_attention"]
    flex, dense = FlexAttention(layout, types, 40, 0.3), DenseAttention(layout, types, 40, 0.3)
    for layer in range(2):
        torch.testing.assert_close(flex(q, k, v, layer), dense(q, k, v, layer), rtol=1e-5, atol=1e-5)


def test_document_causal_block_mask_matches_per_document_causal():
    from torch.nn.attention.flex_attention import flex_attention

    from draftline.model.attention import document_causal_block_mask

    torch.manual_seed(2)
    lengths = torch.tensor([130, 5, 260, 1, 90])
    total = int(lengths.sum())
    mask = document_causal_block_mask(lengths, torch.device("cpu"))
    q, k, v = (torch.randn(1, 2, total, 8) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=mask)
    start = 0
    for n in lengths.tolist():
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start : start + n], k[:, :, start : start + n], v[:, :, start : start + n], is_causal=True)
        torch.testing.assert_close(out[:, :, start : start + n], ref, rtol=1e-5, atol=1e-5)
        start += n


def _full_tiles_by_loop(layout, touched):
    """The full-tile rule tile by tile (the reference for the vectorised ``block_tiles``)."""
    from draftline.model.attention import TILE

    block, anchors = layout.block_size, layout.anchor_doc.shape[0]
    doc_start = {}
    for i, d in enumerate(layout.context_doc.tolist()):
        doc_start.setdefault(d, i)
    ctx_lo = torch.tensor([doc_start.get(d, 0) for d in layout.anchor_doc.tolist()])
    ctx_hi = ctx_lo + layout.anchor_pos
    full = torch.zeros_like(touched)
    for t in range(touched.shape[0]):
        lo, hi = (t * TILE) // block, min(((t + 1) * TILE - 1) // block, anchors - 1)
        if lo > hi or (layout.anchor_doc[lo : hi + 1] != layout.anchor_doc[lo]).any():
            continue
        start, stop = -(-int(ctx_lo[lo : hi + 1].max()) // TILE), int(ctx_hi[lo : hi + 1].min()) // TILE
        if stop > start:
            full[t, start:stop] = True
    return full


@pytest.mark.parametrize("block", [4, 16, 10])
def test_full_tiles_equal_the_tile_by_tile_rule(block):
    from draftline.model.attention import block_tiles

    g = torch.Generator().manual_seed(7 + block)
    lengths = [300, 41, 700, 129, 1000]
    anchors = [sorted(torch.randperm(n - 1, generator=g)[: min(n - 1, 40)].tolist()) for n in lengths]
    layout = layout_for(lengths, anchors, block)
    partial, full = block_tiles(layout, sliding=False)
    assert full.any()
    assert torch.equal(full, _full_tiles_by_loop(layout, partial | full))


def test_tiles_of_a_moved_layout_come_from_its_host_copy():
    """A layout moved to a device keeps its host copy: the flex mask's tiles are built from it, without
    copying device tensors back (on a GPU that copy waits for every kernel in flight)."""
    from draftline.model.attention import block_tiles

    layout = layout_for([300, 41, 700], [[5, 77, 200], [3], [10, 400, 650]], 16)
    pinned_like = layout.to("cpu")
    assert pinned_like.host is layout
    moved = pinned_like.to("meta")  # a device whose tensors cannot be read back: any .cpu() would raise
    assert moved.host is layout and moved.on_host() is layout
    for sliding in (False, True):
        for got, want in zip(block_tiles(moved, sliding=sliding), block_tiles(layout, sliding=sliding)):
            assert torch.equal(got, want)


def test_the_flex_mask_reads_tensors_only_and_compiles_without_duck_shaping():
    """The mask function closes over no integer of the layout (every pass shape shares one kernel) and
    compiles with per-tensor size symbols, as the FlashAttention-4 backend needs, to the dense result."""
    import torch.nn.attention.flex_attention as fa

    from draftline.model.attention import flex_compile_shapes

    torch.manual_seed(0)
    layout = layout_for([9, 13, 4], [[1, 5, 7], [0, 4, 11], [2]], block=4)
    flex = FlexAttention(layout, ["full_attention", "sliding_attention"], 5, 8**-0.5)
    for mask in flex.block_masks.values():
        cells = [c.cell_contents for c in mask.mask_mod.__closure__ or ()]
        assert all(isinstance(c, (torch.Tensor, bool)) or c is None for c in cells), cells
    dense = DenseAttention(layout, ["full_attention", "sliding_attention"], 5, 8**-0.5)
    compiled = torch.compile(fa.flex_attention, dynamic=True, backend="aot_eager")
    kv = layout.num_context + layout.num_queries
    q, k, v = torch.randn(1, 4, layout.num_queries, 8), torch.randn(1, 2, kv, 8), torch.randn(1, 2, kv, 8)
    with flex_compile_shapes({"BACKEND": "FLASH"}):
        from torch.fx.experimental import _config as fx_config

        assert fx_config.use_duck_shape is False
        for layer, kind in enumerate(["full_attention", "sliding_attention"]):
            out = compiled(q, k, v, block_mask=flex.block_masks[kind], scale=8**-0.5, enable_gqa=True)
            torch.testing.assert_close(out, dense(q, k, v, layer), rtol=1e-5, atol=1e-5)
    assert fx_config.use_duck_shape is True


# ------------------------------------------------------------------ which kernel 'auto' picks
def _tiny_config(**overrides):
    from types import SimpleNamespace

    return SimpleNamespace(**{"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 40, **overrides})


def test_auto_attention_is_dense_on_cpu_and_flash_names_why_it_cannot_run():
    from draftline.errors import DraftlineError
    from draftline.model.attention import auto_backend, flash_unavailable, make_attention

    layout = layout_for([50], [[3, 20]], 4)
    assert auto_backend(torch.device("cpu"), _tiny_config()) == "dense"
    assert isinstance(make_attention(layout, _tiny_config()), DenseAttention)
    assert "cpu" in flash_unavailable(torch.device("cpu"), 128)
    with pytest.raises(DraftlineError, match="--attention flash.*cpu"):
        make_attention(layout, _tiny_config(), "flash")


def test_auto_attention_takes_flash_only_when_its_first_check_passes(monkeypatch):
    import draftline.model.attention as attention

    monkeypatch.setattr(attention, "_AUTO", {})
    monkeypatch.setattr(attention, "flash_unavailable", lambda device, head_dim: None)
    monkeypatch.setattr(attention, "probe_flash", lambda device, config: "LoweringError: no kernel")
    with pytest.warns(UserWarning, match="LoweringError: no kernel.*flex's Triton kernels"):
        assert attention.auto_backend(torch.device("cuda"), _tiny_config()) == "flex"
    monkeypatch.setattr(attention, "probe_flash", lambda device, config: None)
    assert attention.auto_backend(torch.device("cuda"), _tiny_config()) == "flex"  # decided once per shape
    assert attention.auto_backend(torch.device("cuda"), _tiny_config(head_dim=32)) == "flash"
    monkeypatch.setattr(attention, "flash_unavailable", lambda device, head_dim: "not installed")
    assert attention.auto_backend(torch.device("cuda"), _tiny_config(head_dim=64)) == "flex"


def test_flash_probe_compares_with_dense_attention(monkeypatch):
    # flex has no backward on CPU: the probe's kernel is stood in for by the dense path (in bf16),
    # which passes; one 10% off fails, the reason naming the layer kind and the tensor.
    import draftline.model.attention as attention

    class Standin(DenseAttention):
        factor = 1.0

        def __init__(self, layout, types, window, scale, kernel):
            assert kernel == "flash"
            super().__init__(layout, types, window, scale)

        def __call__(self, q, k, v, layer):
            return self.factor * super().__call__(q, k, v, layer)

    monkeypatch.setattr(attention, "FlexAttention", Standin)
    state = torch.random.get_rng_state()
    assert attention.probe_flash(torch.device("cpu"), _tiny_config()) is None
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's random state is not touched
    Standin.factor = 1.1
    reason = attention.probe_flash(torch.device("cpu"), _tiny_config())
    assert reason is not None and "differs from dense attention" in reason and "output" in reason
