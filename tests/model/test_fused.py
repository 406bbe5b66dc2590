"""The compiled drafter (draftline.model.fused) computes what the eager drafter computes."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model.attention import make_attention
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.fused import compile_drafter
from draftline.model.target import load_target_config
from draftline.objective.blocks import build_blocks


def _run(drafter, lengths, device, dtype):
    g = torch.Generator().manual_seed(sum(lengths))
    docs = [(torch.randint(1, 300, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    batch = PackedBatch.from_documents(docs)
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    anchors = torch.cat([s + torch.arange(0, n - 1, 3) for s, n in zip(starts.tolist(), lengths)])
    blocks = build_blocks(batch, anchors, block_size=drafter.block_size, mask_token_id=0, gamma=4.0).to(device)
    hidden = drafter.config.hidden_size
    feats = torch.randn(batch.num_tokens, len(drafter.target_layer_ids) * hidden, generator=g).to(device)
    embeds = torch.randn(blocks.block_input_ids.shape[0], hidden, generator=g).to(device)
    # Dense attention everywhere: the compiled halves are under test, not flex (whose tiny-shape
    # decoding path rejected head_dim 16 on the H200 when this test first ran with it).
    attend = make_attention(blocks.layout, drafter.config, "dense")
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = drafter(embeds.to(dtype), feats.to(dtype), blocks.block_positions, blocks.context_positions, attend)
    # A fixed random readout: the drafter's output is RMS-normalised, so a loss like out.square().sum()
    # would not depend on any weight but the final norm's (its other gradients are rounding noise).
    readout = torch.randn(out.shape, generator=g).to(device)
    (out.float() * readout).sum().backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    return out.detach().float(), grads


def _pair(qwen3_target, device):
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)
    torch.manual_seed(0)
    eager = DFlashDrafter(config).to(device)
    eager.reset_parameters(std=0.1)
    compiled = DFlashDrafter(config).to(device)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def test_compiled_layers_keep_state_dict_and_capture_whole_halves(qwen3_target):
    """CPU, graph capture only (aot_eager, no code generation): one graph per half, same result."""
    eager, compiled = _pair(qwen3_target, torch.device("cpu"))
    names = list(compiled.state_dict())
    original = torch.compile
    try:
        torch.compile = lambda fn, dynamic=None, options=None: original(fn, dynamic=dynamic, backend="aot_eager",
                                                                        fullgraph=True)
        compile_drafter(compiled)
    finally:
        torch.compile = original
    assert list(compiled.state_dict()) == names  # checkpoints do not see the compilation
    ref_out, ref_grads = _run(eager, [40, 23], torch.device("cpu"), torch.float32)
    out, grads = _run(compiled, [40, 23], torch.device("cpu"), torch.float32)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():  # fp32 summation order differs between the graphs: norm-relative
        assert _rel(grad, ref_grads[name]) < 1e-5, name


def test_every_half_runs_compiled_however_small_dynamo_s_cache(qwen3_target):
    """Every layer's halves, wrapped for recomputation, are one code object to dynamo, with an entry per half and
    per variant (here: whether the input requires a gradient); on the H200 the 8B line ran out of the default 8
    entries and the rest ran eager. ``compile_drafter`` makes room: with the cache set to 2 entries first, every
    variant still gets its graph (4 for the halves, the context projection's and the final norm's)."""
    from torch._dynamo.backends.registry import lookup_backend

    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=3, block_size=4)
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(std=0.1)
    graphs = []
    aot_eager = lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    original, limit = torch.compile, torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    try:
        torch._dynamo.config.recompile_limit = 2
        torch.compile = lambda fn, dynamic=None, options=None: original(fn, dynamic=dynamic, backend=counting)
        compile_drafter(drafter, recompute="cheap")
        _run(drafter, [40, 23], torch.device("cpu"), torch.float32)
    finally:
        torch.compile = original
        torch._dynamo.config.recompile_limit = limit
    assert len(graphs) == 6, len(graphs)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recompute", ["none", "cheap", "mlp"])
def test_compiled_drafter_equals_eager_on_cuda_in_bf16(qwen3_target, recompute):
    """Inductor's fused bf16 kernels are as close to the fp32 result as eager bf16 is, whatever the halves
    recompute in backward (``model.recompute``).

    Both bf16 runs are measured against the eager fp32 run: the compiled one may round differently
    but not worse (a wrong function would be off by ~100%, bf16 rounding is ~1e-2).
    """
    device = torch.device("cuda")
    eager, compiled = _pair(qwen3_target, device)
    compile_drafter(compiled, recompute=recompute)
    for lengths in ([40, 23], [71]):  # a second shape: dynamic, no recompilation needed
        ref_out, ref_grads = _run(eager, lengths, device, torch.float32)
        bf_out, bf_grads = _run(eager, lengths, device, torch.bfloat16)
        out, grads = _run(compiled, lengths, device, torch.bfloat16)
        assert _rel(out, ref_out) < max(2 * _rel(bf_out, ref_out), 1e-2)
        for name, grad in grads.items():
            eager_err = _rel(bf_grads[name], ref_grads[name])
            assert eager_err < 5e-2, (name, eager_err)  # the readout makes every gradient signal, not noise
            assert _rel(grad, ref_grads[name]) < max(2 * eager_err, 1e-2), (name, _rel(grad, ref_grads[name]), eager_err)


def compiled_graphs_after_first_pass(lengths_after: list[list[int]]) -> int:
    """Graphs dynamo compiles for passes of ``lengths_after`` once a compiled drafter of hidden 1,024 has run one
    pass of 700 tokens (~930 query rows) on CUDA in bf16."""
    from transformers import Qwen3Config

    torch._dynamo.reset()
    target = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(target, num_hidden_layers=1, block_size=4)).cuda()
    drafter.reset_parameters(std=0.02)
    compile_drafter(drafter)
    stats = torch._dynamo.utils.counters["stats"]
    _run(drafter, [700], torch.device("cuda"), torch.bfloat16)
    before = stats["unique_graphs"]
    for lengths in lengths_after:
        _run(drafter, lengths, torch.device("cuda"), torch.bfloat16)
    return stats["unique_graphs"] - before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_passes_of_every_size_run_the_graphs_of_the_first_on_cuda():
    """A pass's rows change with every batch. Inductor fuses a norm's two backward reductions only past thresholds
    on the rows, and guards on them (``fused.one_kernel_for_every_size``): at hidden 1,024 they fall at 2,048, 4,096
    and 5,120 rows. Passes on every side of them (query rows ~2,700 to ~10,700; context 2,000 to 8,000 tokens)
    compile nothing after the first pass."""
    assert compiled_graphs_after_first_pass([[2000], [3500], [4200], [4200, 3800]]) == 0


def test_inference_calls_run_the_eager_code(qwen3_target):
    """No gradients or an inference cache: the compiled functions are not called (evaluation in training)."""
    from draftline.model.drafter import ContextCache

    _, drafter = _pair(qwen3_target, torch.device("cpu"))
    calls = []
    original = torch.compile
    try:
        def counting(fn, dynamic=None, options=None):
            def compiled(*args, **kwargs):
                calls.append(fn.__name__)
                return fn(*args, **kwargs)
            return compiled

        torch.compile = counting
        compile_drafter(drafter)
    finally:
        torch.compile = original
    _run(drafter, [30], torch.device("cpu"), torch.float32)  # training: every compiled half runs
    assert {"attention_inputs", "attention_outputs_and_mlp", "project_context", "forward"} <= set(calls)
    calls.clear()
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        feats = torch.randn(5, len(drafter.target_layer_ids) * hidden)
        attend = lambda q, k, v, i: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        drafter(torch.randn(4, hidden), feats, torch.arange(5, 9), torch.arange(5), attend, ContextCache())
    assert calls == []
