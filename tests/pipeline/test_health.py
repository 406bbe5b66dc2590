"""The watchdog's rules, on a store written by hand: hung, warming up, dead; passes that take turns."""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed as dist

from draftline.pipeline.health import Health, RankInfo


def _health(store, **kwargs) -> Health:
    return Health(RankInfo(0, "drafter", "here", "CPU", os.getpid()), store, world_size=2, **kwargs)


def _peer(store, *, progress_age: float, warm: bool, pid: int | None = None) -> None:
    info = RankInfo(1, "target", "here", "CPU", os.getpid() if pid is None else pid)
    store.set("rank/1", json.dumps(info.__dict__))
    now = time.time()
    store.set("hb/1", json.dumps({"time": now, "progress": now - progress_age, "warm": warm, "stats": {}}))


def test_a_warm_rank_without_progress_is_hung():
    store = dist.HashStore()
    health = _health(store, timeout_s=5.0)
    _peer(store, progress_age=1.0, warm=True)
    assert health.scan() is None
    _peer(store, progress_age=10.0, warm=True)
    message = health.scan()
    assert message is not None and "target rank 1" in message and "is hung" in message


def test_a_rank_still_compiling_gets_the_startup_timeout():
    store = dist.HashStore()
    health = _health(store, timeout_s=5.0, startup_timeout_s=60.0)
    _peer(store, progress_age=30.0, warm=False)
    assert health.scan() is None  # 30 s into its first pass: compiling, not hung
    _peer(store, progress_age=90.0, warm=False)
    assert "is hung" in (health.scan() or "")


def test_a_dead_process_is_named():
    store = dist.HashStore()
    health = _health(store, timeout_s=5.0)
    child = torch.multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    _peer(store, progress_age=0.0, warm=True, pid=child.pid)
    message = health.scan() or ""
    assert f"pid {child.pid}" in message and "died" in message


def test_first_pass_marks_the_rank_warm_and_the_heartbeat_says_so():
    store = dist.HashStore()
    health = _health(store)
    health._beat()
    assert json.loads(store.get("hb/0"))["warm"] is False
    with health.compute_pass():
        pass
    health._beat()
    assert health.warm and json.loads(store.get("hb/0"))["warm"] is True


def _overlaps(health: Health) -> bool:
    inside, overlapped = [0], [False]
    lock = threading.Lock()

    def work():
        for _ in range(20):
            with health.compute_pass():
                with lock:
                    inside[0] += 1
                    overlapped[0] |= inside[0] > 1
                time.sleep(0.002)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return overlapped[0]


def test_colocated_threads_take_turns_for_every_pass():
    shared = _health(None)
    shared.shared_process = True
    assert not _overlaps(shared)
    separate = _health(None)  # one worker thread per process: only the first pass is guarded
    assert _overlaps(separate)
