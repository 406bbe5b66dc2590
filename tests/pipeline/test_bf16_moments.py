"""AdamW with bf16 moments (pipeline.optim.AdamWBf16Moments): torch's AdamW arithmetic, moments rounded
stochastically, the fused AdamW's gradient factor and skip flag, bf16 kept through a checkpoint."""

from __future__ import annotations

import pytest
import torch

from draftline.config import OptimConfig
from draftline.pipeline.optim import (
    AdamWBf16Moments,
    _bf16_stochastic,
    adamw_bf16_moments_update,
    build_optimizer,
    skips_on_device,
    step_with_factor,
)


def _pair(weight_decay=0.1, betas=(0.9, 0.95)):
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(7))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kw = dict(lr=1e-2, betas=betas, weight_decay=weight_decay)
    return ref, torch.optim.AdamW(ref, **kw), ours, AdamWBf16Moments(ours, **kw)


def test_first_step_is_torch_adamw():
    """Step 1 reads zero moments (exact in bf16): the update is torch.optim.AdamW's, to fp32 rounding."""
    ref, ref_opt, ours, opt = _pair()
    for a, b in zip(ref, ours):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    ref_opt.step()
    opt.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
        assert opt.state[b]["exp_avg"].dtype == torch.bfloat16 and opt.state[b]["exp_avg_sq"].dtype == torch.bfloat16
        torch.testing.assert_close(opt.state[b]["exp_avg"].float(), ref_opt.state[a]["exp_avg"], rtol=8e-3, atol=0)


def test_trajectory_stays_near_fp32_moments():
    """50 steps on the same gradients: within 1% of the fp32-moment trajectory's distance travelled."""
    ref, ref_opt, ours, opt = _pair()
    start = [p.detach().clone() for p in ref]
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        for a, b in zip(ref, ours):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ref_opt.step()
        opt.step()
    for a, b, s in zip(ref, ours, start):
        assert (b - a).norm() < 0.01 * (a - s).norm()


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    x = torch.full((200_000,), 1 + 2**-10)  # between the bf16 neighbours 1 and 1 + 2**-7
    assert x.bfloat16().float().unique().tolist() == [1.0]  # round-to-nearest: always down
    torch.manual_seed(0)
    rounded = _bf16_stochastic(x).float()
    assert set(rounded.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5
    signed = _bf16_stochastic(-x).float()
    assert abs(signed.mean().item() + x[0].item()) < 2e-5


def test_a_slow_second_moment_decays_as_in_fp32():
    """beta2 = 0.999 and no gradient: v should fall to 0.999**1000 = 0.368 of itself. Stored to the nearest bf16 it
    would never move (0.999 rounds back to 1); stochastically it follows."""
    torch.manual_seed(0)
    n = 4096
    param, grad = torch.zeros(n), torch.zeros(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    step = torch.zeros(())
    s = lambda x: torch.tensor(float(x))  # noqa: E731
    for _ in range(1000):
        adamw_bf16_moments_update(param, grad, m, v, step, s(1e-3), s(0.9), s(0.999), s(1e-8), s(0.0), s(1.0), s(0.0))
    assert step.item() == 1000
    assert abs(v.float().mean().item() / 0.999**1000 - 1) < 0.02
    assert torch.equal(param, torch.zeros(n))  # no gradient, no first moment: no move


def test_gradient_factor_and_skip_flag_as_the_fused_adamw():
    """step_with_factor hands the factor and the skip flag to the update, as to torch's fused AdamW."""
    _, _, ours, opt = _pair()
    assert skips_on_device(opt)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    twin_opt = AdamWBf16Moments(twin, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for a, b in zip(ours, twin):
        a.grad = torch.randn_like(a)
        b.grad = a.grad * 0.25
    torch.manual_seed(3)
    step_with_factor(opt, ours, torch.tensor(0.25))
    torch.manual_seed(3)  # the same rounding noise
    twin_opt.step()
    for a, b in zip(ours, twin):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], twin_opt.state[b]["exp_avg"])
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["step"].clone()) for p in ours]
    step_with_factor(opt, ours, torch.tensor(1.0), skip=torch.tensor(True))
    for p, (weight, moment, count) in zip(ours, before):
        assert torch.equal(p, weight) and torch.equal(opt.state[p]["exp_avg"], moment)
        assert torch.equal(opt.state[p]["step"], count)


def test_moments_stay_bf16_through_a_checkpoint():
    _, _, ours, opt = _pair()
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    again = AdamWBf16Moments([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=1e-2, betas=(0.9, 0.95))
    again.load_state_dict(saved)
    for a, b in zip(opt.state.values(), again.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert b[key].dtype == torch.bfloat16 and torch.equal(a[key], b[key])
        assert torch.equal(a["step"], b["step"])


def test_build_optimizer_chooses_and_refuses():
    model = torch.nn.Linear(4, 3)
    config = OptimConfig()
    assert isinstance(build_optimizer(model, config), torch.optim.AdamW)
    chosen = build_optimizer(model, config, moments="bf16")
    assert isinstance(chosen, AdamWBf16Moments)
    assert [g["weight_decay"] for g in chosen.param_groups] == [config.weight_decay, 0.0]
    with pytest.raises(ValueError, match="moments"):
        build_optimizer(model, config, moments="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_update_on_cuda_follows_fp32_moments():
    """On CUDA each tensor's update is compiled (its own random rounding): 20 steps stay within 1% of the fp32-moment
    trajectory, the moments stay bf16, and a skipped step changes nothing."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(256, 128, device="cuda")), torch.nn.Parameter(torch.randn(128, device="cuda"))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    start = [p.detach().clone() for p in ref]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt, opt = torch.optim.AdamW(ref, fused=True, **kw), AdamWBf16Moments(ours, **kw)
    for _ in range(20):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ref_opt.step()
        step_with_factor(opt, ours, torch.tensor(1.0, device="cuda"))
    for a, b, s in zip(ref, ours, start):
        assert (b - a).norm() < 0.01 * (a - s).norm()
        assert opt.state[b]["exp_avg_sq"].dtype == torch.bfloat16
    before = [p.detach().clone() for p in ours]
    step_with_factor(opt, ours, torch.tensor(1.0, device="cuda"), skip=torch.tensor(True, device="cuda"))
    assert all(torch.equal(p, q) for p, q in zip(ours, before))
