"""Selective recomputation (draftline.model.recompute): the same numbers, less kept for backward."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from draftline.data.batch import PackedBatch
from draftline.model.attention import make_attention
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.recompute import selective
from draftline.objective.blocks import build_blocks

HIDDEN, INTERMEDIATE, KV_WIDTH = 64, 96, 32


def _config(layers=2):
    target = Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=INTERMEDIATE, vocab_size=300, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return build_drafter_config(target, num_hidden_layers=layers, block_size=4)


def _drafters(dtype, layers=2):
    config = _config(layers)
    torch.manual_seed(0)
    plain = DFlashDrafter(config).to(dtype)
    plain.reset_parameters(std=0.1)
    lean = DFlashDrafter(config).to(dtype)
    lean.load_state_dict(plain.state_dict())
    return plain, lean


def _make_lean(drafter, mode):
    for layer in drafter.layers:
        for name in ("attention_inputs", "attention_outputs_and_mlp"):
            setattr(layer, name, selective(getattr(layer, name), mode, intermediate_size=INTERMEDIATE))


def _inputs(drafter, dtype, lengths=(40, 23)):
    g = torch.Generator().manual_seed(sum(lengths))
    docs = [(torch.randint(1, 300, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    batch = PackedBatch.from_documents(docs)
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    anchors = torch.cat([s + torch.arange(0, n - 1, 3) for s, n in zip(starts.tolist(), lengths)])
    blocks = build_blocks(batch, anchors, block_size=drafter.block_size, mask_token_id=0, gamma=4.0)
    feats = torch.randn(batch.num_tokens, len(drafter.target_layer_ids) * HIDDEN, generator=g, dtype=torch.float64)
    embeds = torch.randn(blocks.block_input_ids.shape[0], HIDDEN, generator=g, dtype=torch.float64)
    readout = torch.randn(blocks.block_input_ids.shape[0], HIDDEN, generator=g, dtype=torch.float64)
    cast = torch.bfloat16 if dtype == "autocast" else dtype
    return blocks, feats.to(cast), embeds.to(cast), readout


def _step(drafter, blocks, feats, embeds, readout, autocast):
    attend = make_attention(blocks.layout, drafter.config, "dense")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = drafter(embeds, feats, blocks.block_positions, blocks.context_positions, attend)
    (out.double() * readout).sum().backward()  # a fixed readout: every weight gets a gradient that is signal
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("mode", ["cheap", "mlp"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, "autocast"])
def test_eager_recomputation_gives_the_same_bits(mode, dtype):
    """Output and every gradient bit-identical to the plain drafter: fp64, fp32, and fp32 weights under bf16
    autocast (the training configuration, where the bf16 weight copies are the recomputed casts)."""
    param_dtype = torch.float32 if dtype == "autocast" else dtype
    plain, lean = _drafters(param_dtype)
    _make_lean(lean, mode)
    inputs = _inputs(plain, dtype)
    ref_out, ref_grads = _step(plain, *inputs, autocast=dtype == "autocast")
    out, grads = _step(lean, *inputs, autocast=dtype == "autocast")
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    assert all(g.abs().sum() > 0 for g in grads.values())  # the comparison is not of zeros


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="recompute mode"):
        selective(lambda x: x, "everything", intermediate_size=INTERMEDIATE)


def _saved_by_compiled_halves(mode):
    """What the compiled halves keep for backward: the backward graphs' inputs other than the incoming gradients,
    as the partitioner Inductor uses (min-cut) leaves them; no code generation."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward_compiler(gm, _inputs):
        return make_boxed_func(gm.forward)

    def backward_compiler(gm, _inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and not node.name.startswith("tangents") and isinstance(value, torch.Tensor):
                saved.append((tuple(int(s) for s in value.shape), value.dtype))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    _, drafter = _drafters(torch.float32, layers=1)
    layer = drafter.layers[0]
    for name in ("attention_inputs", "attention_outputs_and_mlp"):
        fn = selective(getattr(layer, name), mode, intermediate_size=INTERMEDIATE)
        setattr(layer, name, torch.compile(fn, backend=backend, fullgraph=True))
    blocks, feats, embeds, readout = _inputs(drafter, "autocast")
    _step(drafter, blocks, feats, embeds, readout, autocast=True)
    torch._dynamo.reset()
    rows = blocks.block_input_ids.shape[0]
    weights = {tuple(p.shape) for p in layer.parameters() if p.ndim == 2}
    params = {(tuple(p.shape), p.dtype) for p in layer.parameters()}
    return [entry for entry in saved if entry not in params], rows, weights  # the fp32 weights live on anyway


def test_compiled_halves_keep_no_weight_copies_norm_outputs_or_swiglu_product():
    """Under the partitioner torch.compile uses, "cheap" keeps no bf16 copy of a weight, no [rows, hidden] bf16
    tensor beyond the layer input, q before its norm and o_proj's output, and of [rows, intermediate] only gate
    and up; "mlp" not even those; both keep fewer bytes than "none"."""

    def nbytes(entries):
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in entries)

    none, rows, weights = _saved_by_compiled_halves("none")
    cheap, _, _ = _saved_by_compiled_halves("cheap")
    mlp, _, _ = _saved_by_compiled_halves("mlp")

    def count(entries, shape, dtype=torch.bfloat16):
        return sum(1 for s, d in entries if s == shape and d == dtype)

    bf16_weights = [(s, d) for s, d in none if d == torch.bfloat16 and s in weights]
    assert bf16_weights, "the plain partition was expected to keep autocast's weight copies"
    for entries in (cheap, mlp):
        assert not [(s, d) for s, d in entries if d == torch.bfloat16 and s in weights]
    assert count(none, (rows, INTERMEDIATE)) == 3  # gate, up and their SwiGLU product
    assert count(cheap, (rows, INTERMEDIATE)) == 2
    assert count(mlp, (rows, INTERMEDIATE)) == 0
    # the layer input (read by both halves: one tensor), q before its norm, o_proj's output
    assert count(cheap, (rows, HIDDEN)) == 4 < count(none, (rows, HIDDEN))
    assert nbytes(mlp) < nbytes(cheap) < nbytes(none)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_recomputation_keeps_less_memory_on_cuda():
    """On CUDA, compiled (Inductor, flex attention): the memory a training forward leaves for its backward drops by
    at least 80% of what "cheap" stops keeping per layer (both norms' outputs, the transposed attention output,
    the SwiGLU product, the bf16 weight copies), and "mlp" keeps less again."""
    from draftline.model.fused import compile_drafter

    target = Qwen3Config(hidden_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=128, intermediate_size=1536, vocab_size=300, max_position_embeddings=8192,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = build_drafter_config(target, num_hidden_layers=2, block_size=16)
    device = torch.device("cuda")
    tokens = 2048
    batch = PackedBatch.from_documents([(list(range(1, tokens + 1)), [True] * tokens)])
    blocks = build_blocks(batch, torch.arange(1, tokens - 1, 32), block_size=16, mask_token_id=0, gamma=7.0).to(device)
    rows, hidden, inter = blocks.block_input_ids.shape[0], config.hidden_size, config.intermediate_size
    feats = torch.randn(tokens, len(config.dflash_config["target_layer_ids"]) * hidden, device=device).bfloat16()
    embeds = torch.randn(rows, hidden, device=device).bfloat16()
    kept = {}
    for mode in ("none", "cheap", "mlp"):
        torch.manual_seed(0)
        drafter = compile_drafter(DFlashDrafter(config).to(device), recompute=mode)
        attend = make_attention(blocks.layout, config, "flex")
        for measure in (False, True):  # the first pass compiles
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = drafter(embeds, feats, blocks.block_positions, blocks.context_positions, attend)
            torch.cuda.synchronize()
            if measure:
                kept[mode] = torch.cuda.memory_allocated() - base
            out.float().sum().backward()
            drafter.zero_grad(set_to_none=True)
            del out
        del drafter
        torch._dynamo.reset()
    layer_params = sum(p.numel() for p in DFlashDrafter(config).layers[0].parameters() if p.ndim == 2)
    q_width = config.num_attention_heads * config.head_dim
    dropped = 2 * (2 * rows * hidden + rows * q_width + rows * inter + layer_params)  # bf16 bytes per layer
    assert kept["none"] - kept["cheap"] >= 0.8 * config.num_hidden_layers * dropped, kept
    assert kept["cheap"] - kept["mlp"] >= 0.8 * config.num_hidden_layers * 2 * 2 * rows * inter, kept
