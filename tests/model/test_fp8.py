"""The target's linear layers in FP8: each product against its own dequantized arithmetic, its distance from the
full-precision layer, which layers are converted, and the features of a converted target."""

from __future__ import annotations

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model.fp8 import E4M3_MAX, Fp8Linear, convert_linears, quantize_rows
from draftline.model.target import TargetFeatures


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear(in_features=96, out_features=64, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # rows of very different sizes: a scale applied to the wrong axis shows
        linear.weight.mul_(torch.logspace(-2, 1, out_features)[:, None])
    return linear


def test_rows_are_scaled_into_range_without_saturating():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    values, scales = quantize_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 1)
    magnitudes = values.float().abs().amax(dim=1)
    torch.testing.assert_close(magnitudes[:4], torch.full((4,), E4M3_MAX))  # each row's largest entry maps to 448
    assert scales[4].item() == 1.0 and values[4].float().abs().max().item() == 0.0  # a row of zeros stays zero
    assert _relative(values.float()[:4] * scales[:4], x[:4]) < 0.05


def test_the_product_is_its_dequantized_arithmetic():
    linear = _linear()
    fp8 = Fp8Linear(linear)
    x = torch.randn(3, 7, 96) * torch.logspace(-1, 2, 7)[None, :, None]
    y = fp8(x)
    assert y.shape == (3, 7, 64) and y.dtype == torch.float32
    values, scales = quantize_rows(x.reshape(-1, 96))
    weight = fp8.weight_fp8.float() * fp8.weight_scale.t()
    reference = (values.float() * scales) @ weight.t() + linear.bias
    torch.testing.assert_close(y.reshape(-1, 64), reference, rtol=1e-5, atol=1e-5)


def test_the_product_is_within_fp8_rounding_of_the_full_precision_layer():
    linear = _linear()
    fp8 = Fp8Linear(linear)
    x = torch.randn(50, 96) * torch.logspace(-1, 2, 50)[:, None]
    with torch.no_grad():
        exact = linear(x)
    error = _relative(fp8(x), exact)
    assert 1e-3 < error < 0.06  # e4m3 keeps 3 mantissa bits: a few percent, and not zero (it did round)
    per_row = ((fp8(x) - exact).norm(dim=1) / exact.norm(dim=1))
    assert per_row.max().item() < 0.1  # each row scaled on its own: small rows as close as large ones


def test_bf16_inputs_give_bf16_outputs():
    fp8 = Fp8Linear(_linear().to(torch.bfloat16))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    y = fp8(x)
    assert y.dtype == torch.bfloat16
    values, scales = quantize_rows(x)
    reference = (values.float() * scales) @ (fp8.weight_fp8.float() * fp8.weight_scale.t()).t() + fp8.bias.float()
    torch.testing.assert_close(y.float(), reference, rtol=1e-2, atol=1e-2)


def test_convert_replaces_the_linear_layers_fp8_can_take():
    layers = torch.nn.ModuleList([
        torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32, bias=False)),
        torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 20)),  # 20 outputs: not a multiple of 16
    ])
    counts = convert_linears(layers)
    assert counts == {"converted": 2, "kept": 1}
    assert isinstance(layers[0][0], Fp8Linear) and isinstance(layers[0][2], Fp8Linear)
    assert type(layers[1][1]) is torch.nn.Linear and type(layers[1][0]) is torch.nn.LayerNorm
    assert layers[0][2].bias is None
    assert not any(p.dim() == 2 for p in layers[0].parameters())  # the full-precision weights are gone


def _batch():
    docs = [list(range(5, 40)), list(range(100, 117))]
    return PackedBatch.from_documents([(d, [True] * len(d)) for d in docs])


class _Dequantized(torch.nn.Module):
    """The reference: a linear layer's input and weight each rounded to e4m3 by row and dequantized, then multiplied
    in fp32 (no ``_scaled_mm``)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        values, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
        w_values, w_scales = quantize_rows(self.linear.weight)
        y = (values.float() * scales) @ (w_values.float() * w_scales).t()
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


@pytest.mark.parametrize("fixture", ["qwen3_target", "qwen3_5_target"])
def test_an_fp8_target_is_its_model_with_each_linear_layer_rounded(fixture, request):
    from transformers import AutoModelForCausalLM

    target_dir = request.getfixturevalue(fixture)
    fp8 = TargetFeatures(target_dir, [1, 3], dtype=torch.float32, fp8=True)
    assert [m for m in fp8.decoder.modules() if isinstance(m, Fp8Linear)]
    kept = [m for m in fp8.decoder.layers.modules() if type(m) is torch.nn.Linear]
    assert not any(Fp8Linear.takes(m) for m in kept)  # what stays: the Gated DeltaNet's 4-head a and b projections
    assert type(fp8.model.get_output_embeddings()) is torch.nn.Linear  # the LM head keeps its dtype

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for parent in list(model.get_decoder().layers.modules()):
        for name, child in list(parent.named_children()):
            if Fp8Linear.takes(child):
                setattr(parent, name, _Dequantized(child))
    docs = [list(range(5, 40)), list(range(100, 117))]
    with torch.no_grad():
        states = [model(torch.tensor([d]), output_hidden_states=True).hidden_states for d in docs]
    reference = torch.cat([torch.cat([s[2][0], s[4][0]], dim=-1) for s in states])  # layers 1 and 3's outputs
    features = fp8(_batch())
    torch.testing.assert_close(features, reference, rtol=1e-4, atol=1e-4)
    # The rounding did happen. How far it moves features says little here: each product moves by about 3.5%, and
    # these tiny random models, whose residual stream is no larger than its branches, carry that to 10-40%.
    plain = TargetFeatures(target_dir, [1, 3], dtype=torch.float32)(_batch())
    assert _relative(features, plain) > 1e-3


def test_a_split_target_in_fp8_is_refused_with_both_flags():
    from draftline.config import TrainConfig, validate
    from draftline.errors import DraftlineError

    config = TrainConfig()
    config.out, config.model.target, config.data.data = "run", "target", ["data"]
    config.model.target_fp8 = True
    config.topology.target_parallel = 2
    with pytest.raises(DraftlineError, match=r"--target-fp8.*--target-parallel"):
        validate(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_product_is_its_dequantized_arithmetic():
    """cuBLAS's FP8 kernel against the same arithmetic in fp32, at the 27B target's widths, bf16 out."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(5120, 17408, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear(linear)
    x = torch.randn(1000, 5120, device="cuda", dtype=torch.bfloat16)  # rows not a multiple of 16
    y = fp8(x)
    values, scales = quantize_rows(x)
    reference = (values.float() * scales) @ (fp8.weight_fp8.float() * fp8.weight_scale.t()).t()
    assert _relative(y, reference) < 4e-3  # bf16 output rounding
    compiled = torch.compile(fp8, dynamic=True)
    assert _relative(compiled(x), reference) < 4e-3
    assert _relative(y, linear(x)) < 0.06
