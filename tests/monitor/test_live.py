"""The line monitor turns the ranks' cumulative counters into rates from the moment it starts."""

from __future__ import annotations

from types import SimpleNamespace

from draftline.monitor.live import LineMonitor
from draftline.pipeline.progress import Progress
from draftline.sizing.flops import PeakFlops


class _Peers:
    def __init__(self):
        self.target = {"flops": 0.0, "batches": 0, "wait_drafters_s": 0.0}

    def peer_stats(self):
        return {1: {"target": dict(self.target)}, 0: {"drafter": {"wait_s": 0.0}}}


def test_target_work_before_the_start_is_not_in_the_first_interval():
    peers = _Peers()
    schedule = SimpleNamespace(num_epochs=1, total_batches=10, locate=lambda seq: (0, seq),
                               batcher=SimpleNamespace(num_batches=lambda epoch: 10))
    monitor = LineMonitor(
        health=peers, logger=SimpleNamespace(log=lambda record: None), dashboard=None, block_size=4,
        total_steps=10, start_step=0, batches_per_step=1, schedule=schedule, peak=PeakFlops(1e15, "test"),
        num_devices=2, q_pre_capacity=4, q_hs_capacity=4, interval_s=3600.0, progress=Progress(),
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


def _monitor(stats: dict, *, schedule, peak, batches_per_step=1, total_steps=10, reads: list | None = None):
    """A monitor over ``stats`` (every rank's heartbeat); each reading of them appended to ``reads``."""
    def peer_stats():
        if reads is not None:
            reads.append(1)
        return stats

    return LineMonitor(
        health=SimpleNamespace(peer_stats=peer_stats), logger=SimpleNamespace(log=lambda record: None),
        dashboard=None, block_size=4, total_steps=total_steps, start_step=0, batches_per_step=batches_per_step,
        schedule=schedule, peak=peak, num_devices=max(1, len(stats)), q_pre_capacity=4, q_hs_capacity=4, interval_s=3600.0,
        progress=Progress())


def _real_schedule(num_epochs: int):
    import numpy as np

    from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher

    batcher = TokenBudgetBatcher(np.full(20, 100), token_budget=400, max_batch_size=8, seed=0)  # 5 batches an epoch
    return BatchSchedule(batcher, num_epochs)


def test_a_cpu_line_has_no_gpu_rows_and_no_mfu_and_its_layout_is_read_from_the_ranks():
    cpu = {"name": "cpu", "mem_used_gib": None, "mem_total_gib": None, "util": None, "rank": 0,
           "role": "colocated", "sm_mhz": None, "max_sm_mhz": None, "power_w": None, "clock_reasons": None}
    colocated = {0: {"target": {"flops": 1e9, "batches": 1}, "drafter": {"wait_s": 0.0}, "gpu": cpu}}
    schedule = _real_schedule(2)
    measured = PeakFlops(66e9, "a CPU's rate", 66e9, for_mfu=False)
    status = _monitor(colocated, schedule=schedule, peak=measured).snapshot()
    assert status.gpus == [] and status.mfu != status.mfu  # NaN: no MFU against a CPU's measured rate
    assert status.colocated and (status.num_targets, status.num_drafters) == (1, 1)
    given = _monitor(colocated, schedule=schedule, peak=PeakFlops(1e11, "given by the user")).snapshot()
    assert given.mfu == given.mfu  # a peak the user gives is quoted against, CPU or not

    split = {0: {"drafter": {"wait_s": 0.0}, "gpu": {**cpu, "role": "drafter"}},
             1: {"target": {"flops": 0.0, "batches": 0}, "gpu": {**cpu, "rank": 1, "role": "target"}},
             2: {"target": {"flops": 0.0, "batches": 0}, "gpu": {**cpu, "name": "NVIDIA H200", "rank": 2}}}
    status = _monitor(split, schedule=schedule, peak=measured).snapshot()
    assert not status.colocated and (status.num_targets, status.num_drafters) == (2, 1)
    assert [g.rank for g in status.gpus] == [2]  # only the GPU rank has device figures


def test_epochs_trained_count_whole_epochs_at_the_end():
    """A 2-epoch run that is through has trained 2 epochs (its last record says so, not "epoch 1")."""
    schedule = _real_schedule(2)
    assert schedule.total_batches == 10
    monitor = _monitor({}, schedule=schedule, peak=PeakFlops(1e12, "test"), batches_per_step=2, total_steps=5)
    done = {}
    for step in (0, 1, 2, 3, 5):
        monitor.step = step
        status = monitor.snapshot()
        done[step] = (status.epoch, status.epochs_done)
    assert done == {0: (0, 0.0), 1: (0, 0.4), 2: (0, 0.8), 3: (1, 1.2), 5: (1, 2.0)}


def test_compile_time_is_summed_over_ranks_once_per_process_and_the_window_shows_what_is_new():
    """A colocated rank publishes its process's compile seconds as target and as drafter: counted once. Compiling
    before the monitor starts (preflight) is in the total, not in the first window."""
    stats = {0: {"target": {"flops": 0.0, "batches": 0, "compile_s": 30.0}, "drafter": {"wait_s": 0.0, "compile_s": 30.0}},
             1: {"target": {"flops": 0.0, "batches": 0, "compile_s": 12.0}, "drafter": {"wait_s": 0.0, "compile_s": 12.0}}}
    reads = []
    monitor = _monitor(stats, schedule=_real_schedule(1), peak=PeakFlops(1e15, "test"), reads=reads)
    monitor.start()
    try:
        reads.clear()
        first = monitor.snapshot()
        assert len(reads) == 1  # every rank's heartbeat is read from the store once a snapshot
        assert (first.compile_s, first.compiling_s) == (42.0, 0.0)
        stats[1]["drafter"]["compile_s"] = stats[1]["target"]["compile_s"] = 32.0  # rank 1 compiled a new shape
        second = monitor.snapshot()
        assert (second.compile_s, second.compiling_s) == (62.0, 20.0)
        assert second.to_record()["compiling_s"] == 20.0
        third = monitor.snapshot()
        assert (third.compile_s, third.compiling_s) == (62.0, 0.0)
    finally:
        monitor._stop.set()
