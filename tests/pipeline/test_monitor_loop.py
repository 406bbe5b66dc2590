"""The line monitor turns the ranks' cumulative counters into rates from the moment it starts."""

from __future__ import annotations

from types import SimpleNamespace

from draftline.monitor.flops import PeakFlops
from draftline.pipeline.monitor_loop import LineMonitor


class _Peers:
    def __init__(self):
        self.target = {"flops": 0.0, "batches": 0, "wait_drafters_s": 0.0}

    def peer_stats(self):
        return {1: {"target": dict(self.target)}, 0: {"drafter": {"wait_s": 0.0}}}


def test_target_work_before_the_start_is_not_in_the_first_interval():
    peers = _Peers()
    schedule = SimpleNamespace(num_epochs=1, total_batches=10, locate=lambda seq: (0, seq))
    monitor = LineMonitor(
        health=peers, logger=SimpleNamespace(log=lambda record: None), dashboard=None, block_size=4,
        total_steps=10, start_step=0, batches_per_step=1, schedule=schedule, peak=PeakFlops(1e15, "test"),
        num_devices=2, q_pre_capacity=4, q_hs_capacity=4, interval_s=3600.0,
    )
    # The target warmed up and filled the queue before the drafters began: 5 batches, 5e15 FLOP.
    peers.target.update(flops=5e15, batches=5)
    monitor.start()
    try:
        peers.target.update(flops=6e15, batches=6)  # one batch in the first interval
        monitor.snapshot()
        assert monitor.target_flops.total == 1e15
        assert monitor.target_batches.total == 1
    finally:
        monitor._stop.set()
