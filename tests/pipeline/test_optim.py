"""The gradient factor (scale, then clip) equals scaling, then torch's clip_grad_norm_; the update takes it."""

from __future__ import annotations

import pytest
import torch

from draftline.pipeline.optim import grad_factor, skips_on_device, step_with_factor


@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e6])
def test_grad_factor_equals_scale_then_clip_grad_norm(max_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((7, 3), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params.append(torch.nn.Parameter(torch.randn(4)))  # no gradient: skipped
    ref = [p.grad.clone() for p in params[:-1]]
    scale = torch.tensor(1 / 37.0)
    torch._foreach_mul_(ref, scale)
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(ref_params, ref):
        p.grad = g
    if max_norm > 0:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, foreach=True)
    else:
        ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref]))
    factor, norm = grad_factor(params, scale, max_norm)
    torch._foreach_mul_([p.grad for p in params[:-1]], factor)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, r in zip(params[:-1], ref_params):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-9)
    assert params[-1].grad is None
    if 0 < max_norm < ref_norm:
        clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params[:-1]]))
        torch.testing.assert_close(clipped, torch.tensor(max_norm), rtol=1e-5, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_step_with_factor_equals_multiplying_the_gradients_first(fused):
    """The fused AdamW's in-kernel factor (grad_scale) updates exactly as scaling the gradients, then stepping.

    Adam is nearly blind to a gradient's scale, so the factor is made small enough (gradients near
    its eps of 1e-8) that ignoring it would change the weights: the last check shows it does.
    """
    torch.manual_seed(1)
    shapes = ((16, 8), (8,), (3, 5))
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) * 5 for s in shapes] for _ in range(3)]

    def run(how: str):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused or None)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            factor, _ = grad_factor(params, torch.tensor(1e-9), 1e-7)  # scale, then clip to 1e-7
            if how == "mine":
                step_with_factor(opt, params, factor)
            elif how == "first":
                torch._foreach_mul_([p.grad for p in params], factor)
                opt.step()
            else:  # the factor ignored
                opt.step()
            assert not hasattr(opt, "grad_scale")
        return params

    mine, first, ignored = run("mine"), run("first"), run("ignored")
    for a, b in zip(mine, first):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    gap = max((a - b).abs().max().item() for a, b in zip(mine, ignored))
    assert gap > 1e-3


def test_a_skipped_step_leaves_weights_moments_and_counts_as_if_never_taken():
    """The device flag (``found_inf`` in the fused kernel) against not calling step at all, over a
    bad step whose gradient holds a NaN: the same weights, moments and step counts afterwards."""
    torch.manual_seed(2)
    shapes = ((16, 8), (8,))
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    grads[1][0][3, 2] = float("nan")

    def run(on_device: bool):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            factor, norm = grad_factor(params, torch.tensor(0.5), 1.0)
            bad = ~torch.isfinite(norm)
            if on_device:
                step_with_factor(opt, params, factor, skip=bad)
                assert not hasattr(opt, "found_inf")
            elif not bad:
                step_with_factor(opt, params, factor)
        return params, opt

    (mine, opt_mine), (host, opt_host) = run(True), run(False)
    for a, b in zip(mine, host):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_mine.state[a][key], opt_host.state[b][key], rtol=0, atol=0)
    assert float(opt_mine.state[mine[0]]["step"]) == 3


def test_only_a_fused_optimizer_takes_a_device_skip():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    opt = torch.optim.AdamW([param], lr=1e-2, fused=False)
    assert not skips_on_device(opt)
    with pytest.raises(ValueError, match="only a fused optimizer"):
        step_with_factor(opt, [param], torch.tensor(1.0), skip=torch.tensor(False))
