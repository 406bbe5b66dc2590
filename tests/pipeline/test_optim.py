"""The gradient factor (scale, then clip) equals scaling, then torch's clip_grad_norm_; the update takes it.
The schedule: warmup and cosine over the steps, or over the clock of a time limit where that is further along."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftline.config import OptimConfig
from draftline.pipeline.optim import build_scheduler, grad_factor, lr_factor, skips_on_device, step_with_factor
from draftline.pipeline.progress import Progress


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


def _schedule(total_steps: int, **optim):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer, build_scheduler(optimizer, OptimConfig(**optim), total_steps, Progress())


def _record(clock: float):
    """A step's record as the progress reads it (a finite step of nothing, at ``clock``)."""
    return SimpleNamespace(tokens=0, samples=0, finite=True, clock=clock)


def _lrs(optimizer, schedule, steps: int, clock=lambda step: 0.0) -> list[float]:
    lrs = []
    for step in range(steps):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.run_progress.count(_record(clock(step)))
        schedule.step()
    return lrs


def test_without_a_clock_the_schedule_is_the_steps_warmup_and_cosine():
    optimizer, schedule = _schedule(50, warmup_ratio=0.1, min_lr_ratio=0.1)
    expected = [1e-3 * lr_factor(step, 50, 5, 0.1) for step in range(50)]
    assert _lrs(optimizer, schedule, 50) == pytest.approx(expected, rel=1e-12)
    assert expected[0] == pytest.approx(2e-4) and expected[4] == pytest.approx(1e-3) and expected[-1] < 1.1e-4


def test_a_clock_further_along_than_the_steps_takes_the_schedule_to_its_floor():
    """A time limit that ends the run at step 20 of 1,000: the clock reaches 1 there, the rate its floor."""
    optimizer, schedule = _schedule(1000, warmup_ratio=0.0, min_lr_ratio=0.1)
    lrs = _lrs(optimizer, schedule, 21, clock=lambda step: (step + 1) / 20)
    assert lrs[0] == pytest.approx(1e-3)
    assert lrs[11] == pytest.approx(1e-3 * lr_factor(11 / 20 * 1000, 1000, 0, 0.1))  # halfway: the cosine's middle
    assert lrs[20] == pytest.approx(1e-4)  # the floor
    assert all(a > b for a, b in zip(lrs[1:20], lrs[2:21]))
    # A clock behind the steps does not hold the schedule back.
    optimizer, behind = _schedule(100, warmup_ratio=0.0)
    assert _lrs(optimizer, behind, 30, clock=lambda step: 0.01) == pytest.approx(_lrs(*_schedule(100, warmup_ratio=0.0), 30))


def test_the_clock_is_the_progress_and_saved_with_it_the_steps_are_the_runs_own():
    optimizer, schedule = _schedule(100)
    _lrs(optimizer, schedule, 10, clock=lambda step: 0.4)
    state, progress = schedule.state_dict(), schedule.run_progress.state_dict()
    assert "clock" not in state and "total_steps" not in state and progress["counters"]["clock"] == 0.4
    optimizer2, resumed = _schedule(300)  # a resume with more steps: the schedule's length is the new run's
    resumed.load_state_dict(state)
    resumed.run_progress.load_state_dict(progress)
    assert resumed.clock == 0.4 and resumed.total_steps == 300 and resumed.last_epoch == 10
    assert resumed.progress(10) == pytest.approx(0.4) and resumed.progress(200) == pytest.approx(200 / 300)
    # The clock never goes back (the drafters' agreed share of the time spent) and stops at the limit.
    resumed.run_progress.count(_record(0.1))
    resumed.run_progress.count(_record(1.7))
    assert resumed.clock == 1.0
    # A schedule's state that held a clock (a checkpoint from before the progress held it) leaves it to the
    # progress (``checkpoint.state.load_checkpoint`` hands it over); a plain LambdaLR's state resumes with none.
    _, old = _schedule(100)
    old.load_state_dict({**state, "clock": 0.7})
    assert old.clock == 0.0 and old.total_steps == 100
    optimizer3 = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    plain = torch.optim.lr_scheduler.LambdaLR(optimizer3, lambda step: 1.0)
    _, fresh = _schedule(100)
    fresh.load_state_dict(plain.state_dict())
    assert fresh.clock == 0.0 and fresh.total_steps == 100
