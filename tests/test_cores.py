import os

from draftline.cores import usable_cores


def test_the_affinity_mask_counts_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {14, 15})
    assert usable_cores() == 2


def test_without_a_mask_every_core_counts(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cores() == 16
