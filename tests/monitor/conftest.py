"""A filled-in status shared by the dashboard and logger tests."""

from __future__ import annotations

import pytest

from draftline.monitor.gpu import GpuStats
from draftline.monitor.status import LineStatus
from draftline.sizing.flops import known_peak


@pytest.fixture
def busy_status() -> LineStatus:
    return LineStatus(
        step=1234, total_steps=10000, epoch=1, num_epochs=6, samples=50000, tokens=141_300_000,
        loss=2.3456, accuracy=0.4123, accuracy_by_position=[0.82, 0.71, 0.6, float("nan")],
        tau=1.87, tau_step=1200, tf_acceptance=3.21, lr=6e-4, grad_norm=0.75, skipped_steps=2,
        ktok_s=20.2, samples_s=7.14, tflops=312.0, mfu=0.396,
        q_pre=[3, 12], q_hs=0, target_wait=0.02, drafter_wait=0.35,
        target_batches_s=1.25, drafter_batches_s=1.1, eta_s=3725.0,
        gpus=[GpuStats("NVIDIA H200", 61.2, 139.8, 0.97, rank=0, role="target", sm_mhz=1755.0,
                       max_sm_mhz=1980.0, power_w=699.0, clock_reasons=["power cap"]),
              GpuStats("NVIDIA H200", None, None, None, rank=1, role="drafter")],
        time=1_700_000_000.0, elapsed_s=600.0, q_pre_capacity=50, q_hs_capacity=20,
        peak=known_peak("NVIDIA H200"), num_targets=2, num_drafters=6,
    )
