"""The watchdog's rules, on a store written by hand: hung, warming up, dead; passes that take turns."""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed as dist

from draftline.distributed.health import Health, RankInfo


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


def _exited_child() -> int:
    """The pid of a process that has exited and been reaped."""
    child = torch.multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    return child.pid


def test_a_dead_process_is_named():
    store = dist.HashStore()
    health = _health(store, timeout_s=5.0)
    pid = _exited_child()
    _peer(store, progress_age=0.0, warm=True, pid=pid)
    message = health.scan() or ""
    assert f"pid {pid}" in message and "died" in message


class _ReportsAfterTheFirstLook:
    """A store on which rank 1 writes its report (``key``) right after the watchdog's first look for it, then exits:
    a rank that finishes, or fails, during a scan."""

    def __init__(self, store, key: str, value: str):
        self.store, self.key, self.value, self.looked = store, key, value, False

    def check(self, keys_: list[str]) -> bool:
        found = self.store.check(keys_)
        if keys_ == [self.key] and not self.looked:
            self.looked = True
            self.store.set(self.key, self.value)
        return found

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_rank_that_reports_done_and_exits_during_a_scan_is_not_named_dead():
    """Its done report lands between the watchdog's look for it and its look at the process, which has exited by
    then: a finished rank, not a dead one (the likely cause of a target group's run once failed near its end under
    load)."""
    store = dist.HashStore()
    _peer(store, progress_age=0.0, warm=True, pid=_exited_child())
    health = _health(_ReportsAfterTheFirstLook(store, "done/1", "1"), timeout_s=5.0)
    assert health.scan() is None
    assert health.failed_rank is None and health.scan() is None  # and it stays finished


def test_a_rank_that_reports_its_failure_and_exits_during_a_scan_is_named_with_its_cause():
    store = dist.HashStore()
    _peer(store, progress_age=0.0, warm=True, pid=_exited_child())
    health = _health(_ReportsAfterTheFirstLook(store, "fail/1", json.dumps({"cause": "CUDA out of memory"})),
                     timeout_s=5.0)
    message = health.scan() or ""
    assert "target rank 1" in message and "failed: CUDA out of memory" in message and health.failed_rank == 1


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
    shared = _health(None, shared_process=True)
    assert not _overlaps(shared)
    separate = _health(None)  # one worker thread per process: only the first pass is guarded
    assert _overlaps(separate)


def _killed_unreaped_child():
    """A process killed with SIGKILL that its parent has not reaped yet (what a rank is while its
    launcher, or the kernel tearing down its GPU context, has not caught up): ``kill(pid, 0)`` still
    succeeds."""
    import signal
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.time() + 5
    while time.time() < deadline and open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.01)
    os.kill(child.pid, 0)  # still there
    return child


def test_a_killed_process_not_yet_reaped_is_named_dead():
    store = dist.HashStore()
    health = _health(store, timeout_s=30.0)
    child = _killed_unreaped_child()
    try:
        _peer(store, progress_age=0.0, warm=True, pid=child.pid)
        message = health.scan() or ""
        assert f"pid {child.pid}" in message and "died" in message
    finally:
        child.wait()


def test_the_watchdog_names_a_killed_neighbour_within_a_second_and_publishes_it():
    """Between two store scans (every 2 s) the watchdog looks at this host's peers every 0.25 s."""
    import signal
    import subprocess

    store = dist.HashStore()
    health = _health(store, timeout_s=30.0, beat_s=2.0)
    child = subprocess.Popen(["sleep", "60"])
    try:
        _peer(store, progress_age=0.0, warm=True, pid=child.pid)
        health.start()
        time.sleep(0.3)  # the first scan has read the peer
        assert health.aborted is None
        killed = time.time()
        os.kill(child.pid, signal.SIGKILL)  # not reaped: a zombie until child.wait()
        while health.aborted is None and time.time() - killed < 5:
            time.sleep(0.01)
        named_after = time.time() - killed
        assert health.aborted and f"pid {child.pid}" in health.aborted and "died" in health.aborted
        assert named_after < 1.0, named_after
        # Every other rank names the same culprit at its next scan.
        other = Health(RankInfo(2, "target", "elsewhere", "CPU", 1), store, world_size=3)
        assert other.scan() == health.aborted and other.failed_rank == 1
    finally:
        health.stop()
        child.kill()
        child.wait()


class _GoneStore:
    """A store whose host is gone: every call fails as TCPStore's do."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return call


def test_a_lost_store_names_the_node_that_hosted_it(monkeypatch):
    from draftline.distributed.failure import find_culprit

    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "29400")
    store = dist.HashStore()
    host = RankInfo(0, "drafter", "node-a", "GPU 0 H200", 4242, node=0)
    store.set("rank/0", json.dumps(host.__dict__))
    store.set("hb/0", json.dumps({"time": time.time(), "progress": time.time(), "warm": True, "stats": {}}))
    me = Health(RankInfo(1, "target", "node-b", "GPU 0 H200", os.getpid(), node=1), store, world_size=2)
    assert me.scan() is None  # rank 0 is known (and healthy) while the store answers
    me.store = _GoneStore()
    message = find_culprit(me, wait_s=1.0)
    assert message == ("lost contact with the job's store at node-a:29400 (hosted by node 0's launcher, which ran "
                       "drafter rank 0 (host node-a, GPU 0 H200, pid 4242)): that node died or its network is down "
                       "(or its launcher ended the job: see node 0's log)")
    assert me.failed_rank == 0
    own = Health(RankInfo(0, "drafter", "node-a", "CPU", os.getpid(), node=0), _GoneStore(), world_size=2)
    assert "this node's own" in own.store_lost()
    me.store = store  # a store that answers is not lost: no culprit from it
    assert find_culprit(me, wait_s=0.3) is None


def test_a_new_stats_section_is_carried_by_a_beat_at_once():
    """A rank's first target (or drafter) numbers reach the monitor with the next beat at once, not up to a beat
    later: a short run's last record counts every rank. Later updates wait for the regular beat."""
    store = dist.HashStore()
    health = _health(store, beat_s=60.0)
    health.start()
    try:
        def published():
            return json.loads(store.get("hb/0"))["stats"]

        assert published() == {}
        health.stats.update("target", {"batches": 1})
        deadline = time.time() + 5
        while "target" not in published() and time.time() < deadline:
            time.sleep(0.01)
        assert published() == {"target": {"batches": 1}}
        health.stats.update("target", {"batches": 2})  # not new: the regular beat, 60 s away, carries it
        time.sleep(0.3)
        assert published() == {"target": {"batches": 1}}
    finally:
        health.stop()
