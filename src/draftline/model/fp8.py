"""The frozen target's linear layers in FP8: weights stored in e4m3 with a scale per output channel, activations cast
per row at each call, the product in ``torch._scaled_mm`` (FP8 tensor cores on Hopper and Blackwell; a reference
kernel on CPU).

For a linear layer ``y = x W^T (+ b)``, ``W`` [N, K]:

    s_w[n] = max_k |W[n, k]| / 448        W8 = e4m3(W / s_w)            (once, when the target loads)
    s_x[m] = max_k |x[m, k]| / 448        x8 = e4m3(x / s_x)            (each call)
    y[m, n] = s_x[m] s_w[n] sum_k x8[m, k] W8[n, k]   (fp32 accumulation, written in x's dtype)

448 is e4m3's largest finite value, so every entry is scaled into range and none saturates. A row of zeros keeps
a scale of 1. This is the rowwise recipe of FP8 serving (vLLM's and SGLang's "dynamic per-token" activations with
per-channel weights): features computed this way are what an FP8-served target computes up to kernel order, not
what a bf16 target computes (tests/model/test_fp8.py checks them against the model with each linear layer rounded
by hand; each product moves by about 3.5% from the full-precision one).

Only the decoder layers' linear layers are converted (attention, MLP, the Gated DeltaNet's projections); the
embedding, the norms, the convolutions and the LM head keep their dtype. A layer whose dimensions the FP8 kernels
cannot take (not multiples of 16) stays as it is.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite e4m3 value."""

ALIGN = 16
"""``torch._scaled_mm`` needs both dimensions of the weight in multiples of 16."""


def rowwise_scales(x: torch.Tensor) -> torch.Tensor:
    """Each row's scale [rows, 1], fp32: its largest magnitude over 448 (1 for a row of zeros)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [rows, K], fp32 scales [rows, 1]) with ``x ~= values * scales`` row by row."""
    scales = rowwise_scales(x)
    values = (x.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, scales


class Fp8Linear(torch.nn.Module):
    """A frozen ``nn.Linear`` whose weight is held in e4m3 with a scale per output channel (the module docstring)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight, scales = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scale", scales.reshape(1, -1).contiguous())  # [1, N], as _scaled_mm takes it
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def takes(linear: torch.nn.Module) -> bool:
        """Whether ``linear`` can be converted: a plain ``nn.Linear`` of a float dtype, both dimensions multiples of
        16."""
        return (type(linear) is torch.nn.Linear and linear.weight.is_floating_point()
                and linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scales = quantize_rows(rows)
        y = torch._scaled_mm(values, self.weight_fp8.t(), scale_a=scales, scale_b=self.weight_scale,
                             out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, scale per output channel"


def convert_linears(layers: torch.nn.Module) -> dict[str, int]:
    """Replace, in place, every ``nn.Linear`` under ``layers`` that FP8 can take by an ``Fp8Linear`` (each bf16
    weight freed as soon as its FP8 copy exists, so converting before moving to the GPU never holds both there).
    Returns ``{"converted": n, "kept": m}`` (m: linear layers with dimensions FP8 cannot take)."""
    converted = kept = 0
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                if Fp8Linear.takes(child):
                    setattr(parent, name, Fp8Linear(child))
                    converted += 1
                else:
                    kept += 1
    return {"converted": converted, "kept": kept}
