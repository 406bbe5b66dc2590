"""Failure detection: heartbeats, failure reports and a watchdog on every rank.

Each rank publishes who it is (role, host, GPU, pid), a heartbeat every ``beat_s`` seconds that
also carries its latest progress time, and - when it fails - the cause. A watchdog thread on every
rank reads the others'. When a rank reports a failure, or its heartbeat or progress stops for
``timeout_s`` (killed, or hung in a kernel or a collective), every rank's ``Health.abort`` is set
with a message that names the role, rank, host, GPU and cause. Blocking waits in the pipeline poll
``Health.check()``, which raises ``RunAborted``; nothing continues with fewer workers.

A killed rank is seen first by the ranks on its host: between two store scans the watchdog looks
at their processes every ``poll_s`` (0.25 s, a /proc read; a zombie or a process in exit counts as
dead). The first rank to name a culprit publishes the message in the store (``abort``), so every
rank, on every host, names the same one at its next scan.

A rank's first pass compiles kernels (flex attention), which can take minutes on a large model:
until a rank reports ``warm`` its progress may pause for ``startup_timeout_s`` instead (the passes
of one process's threads take ``compile_lock.COMPILE_LOCK`` in turn).

The numbers a rank shares with the monitor (``stats.SharedStats``) ride on the heartbeat; the
waits that poll ``check()`` are in ``waits.py``.

A single process (colocated, CPU tests) uses the same object with no store: only local signals.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from draftline.distributed import keys
from draftline.distributed.compile_lock import COMPILE_LOCK
from draftline.distributed.stats import SharedStats


class RunAborted(RuntimeError):
    """The run must stop: another rank failed, a signal arrived, or this rank was told to stop."""


@dataclass
class RankInfo:
    rank: int
    role: str
    host: str
    gpu: str
    pid: int
    node: int = 0  # torchrun's GROUP_RANK: the launcher (node) this rank runs under
    group: str = ""
    """Its place in a target group ("target group 1, its rank 0 of 2"; "" with one rank per target)."""

    def describe(self) -> str:
        group = f"{self.group}; " if self.group else ""
        return f"{self.role} rank {self.rank} ({group}host {self.host}, {self.gpu}, pid {self.pid})"


def local_rank_info(rank: int, role: str, device: torch.device, group: str = "") -> RankInfo:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = f"GPU {index} {torch.cuda.get_device_name(index)}"
    else:
        gpu = "CPU"
    return RankInfo(rank, role, socket.gethostname(), gpu, os.getpid(), int(os.environ.get("GROUP_RANK", "0")), group)


STORE_NODE = 0
"""The node whose launcher hosts the job's store: torchrun's group rank 0 (its agent serves the store the
workers share, at MASTER_ADDR:MASTER_PORT; without that sharing, global rank 0 hosts it, on the same node)."""


def store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def describe_exception(exc: BaseException) -> str:
    """The cause of a failure in words, with what to do for the common ones."""
    from draftline.distributed.memory import describe_out_of_memory, find_out_of_memory

    oom = find_out_of_memory(exc)
    if oom is not None:
        return describe_out_of_memory(oom)
    return f"{type(exc).__name__}: {exc}"[:600]


class Health:
    """This rank's view of the run's health. Thread-safe; cheap to ``check()``."""

    def __init__(self, info: RankInfo, store=None, world_size: int = 1, *, timeout_s: float = 30.0, beat_s: float = 2.0,
                 startup_timeout_s: float = 900.0, shared_process: bool = False):
        self.info = info
        self.store = store
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.startup_timeout_s = max(timeout_s, startup_timeout_s)
        self.warm = False
        self.shared_process = shared_process
        """A target and a drafter run as threads of this process (colocated)."""
        self._warm_threads: set[int] = set()
        self.beat_s = beat_s
        self.poll_s = min(0.25, beat_s)
        """How often the watchdog looks at the processes of peers on this host."""
        self._finished: set[int] = set()
        self._abort: str | None = None
        self.failed_rank: int | None = None  # the rank a failure message is about, when known
        self._lock = threading.Lock()
        self._progress = time.time()
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self.stats = SharedStats(on_new_section=self._beat_now.set)
        """What this rank publishes for the monitor (carried by the heartbeat; a new section at once)."""
        self._threads: list[threading.Thread] = []
        self.peers: dict[int, RankInfo] = {info.rank: info}
        self.stuck_exit_s: float | None = None
        """Set for a sharded drafter: see ``exit_if_stuck``."""
        self._handled = threading.Event()

    # ---------------------------------------------------------------- local state
    def tick(self) -> None:
        """The main loop is alive (called from polling waits and between batches)."""
        self._progress = time.time()

    def watch(self, modules) -> None:
        """Count each module's forward and backward as progress (a long pass is not a hang)."""
        for module in modules:
            module.register_forward_pre_hook(lambda *_: self.tick())
            module.register_full_backward_pre_hook(lambda *_: self.tick())

    @contextmanager
    def compute_pass(self):
        """Around every pass of a worker thread. The first one compiles: once it is done this rank
        counts as warm (the regular hang timeout applies). Under COMPILE_LOCK when colocated."""
        thread = threading.get_ident()
        if thread in self._warm_threads and not self.shared_process:
            yield
            return
        with COMPILE_LOCK:
            self.tick()
            yield
        self._warm_threads.add(thread)
        self.warm = True
        self.tick()

    def exit_if_stuck(self, seconds: float) -> None:
        """After a failure elsewhere, end this process if its main thread has not reached the failure handler
        ``seconds`` later: a sharded drafter can be blocked inside FSDP's gathers and reduce-scatters, which
        do not poll this object, waiting for a rank that is gone."""
        self.stuck_exit_s = seconds

    def handling_failure(self) -> None:
        """The main thread has reached the failure handler: it is not stuck."""
        self._handled.set()

    def _exit_when_stuck(self, message: str) -> None:
        if self._handled.wait(self.stuck_exit_s) or self._stop.is_set():
            return
        print(f"draftline: {self.info.describe()}: stopping: {message} (this rank was blocked in a collective with "
              f"the drafters for {self.stuck_exit_s:.0f} s)", flush=True)
        os._exit(1)

    def abort(self, message: str, *, publish: bool = False, rank: int | None = None) -> None:
        """Stop this rank's waits with ``message``. With ``publish``, the first such message also goes
        to the store, so every rank names the same culprit (``rank``, when known) at its next scan."""
        with self._lock:
            first = self._abort is None
            if first:
                self._abort = message
        if first and publish and self.stuck_exit_s:
            threading.Thread(target=self._exit_when_stuck, args=(message,), name="draftline-stuck", daemon=True).start()
        if first and publish and self.store is not None:
            try:
                if not self.store.check([keys.ABORT]):
                    self.store.set(keys.ABORT, json.dumps({"message": message, "rank": rank}))
            except Exception:  # noqa: BLE001 - the store may be gone; peers find the cause themselves
                pass

    @property
    def aborted(self) -> str | None:
        return self._abort

    def check(self) -> None:
        self.tick()
        if self._abort is not None:
            raise RunAborted(self._abort)

    # ---------------------------------------------------------------- store side
    def start(self) -> None:
        """Publish this rank and start the heartbeat and watchdog threads (no-op without a store)."""
        if self.store is None:
            return
        self.store.set(keys.rank_key(self.info.rank), json.dumps(asdict(self.info)))
        self._beat()
        for target in (self._heartbeat_loop, self._watchdog_loop):
            thread = threading.Thread(target=target, name=f"draftline-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._beat_now.set()

    def report_failure(self, cause: str) -> None:
        """Tell every rank that this one failed, and why (before this process exits)."""
        self.abort(f"{self.info.describe()} failed: {cause}")
        if self.store is not None:
            try:
                self.store.set(keys.fail_key(self.info.rank), json.dumps({"cause": cause, "time": time.time()}))
            except Exception:  # noqa: BLE001 - the store may be gone already; the heartbeat will stop
                pass

    def report_done(self) -> None:
        if self.store is not None:
            try:
                self._beat()  # the final numbers, for the monitor
                self.store.set(keys.done_key(self.info.rank), "1")
            except Exception:  # noqa: BLE001
                pass

    def _beat(self) -> None:
        payload = {"time": time.time(), "progress": self._progress, "warm": self.warm, "stats": self.stats.snapshot()}
        self.store.set(keys.heartbeat_key(self.info.rank), json.dumps(payload))

    def _heartbeat_loop(self) -> None:
        while True:
            self._beat_now.wait(self.beat_s)  # a beat every beat_s, and one at once for a new stats section
            self._beat_now.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - store unreachable: the agent is gone; peers notice us
                return

    def peer(self, rank: int) -> RankInfo:
        if rank not in self.peers:
            try:
                self.peers[rank] = RankInfo(**json.loads(self.store.get(keys.rank_key(rank))))
            except Exception:  # noqa: BLE001
                return RankInfo(rank, "unknown", "?", "?", -1)
        return self.peers[rank]

    def peer_stats(self) -> dict[int, dict]:
        """Latest stats of every rank (for the monitor)."""
        out = {self.info.rank: self.stats.snapshot()}
        if self.store is None:
            return out
        for rank in range(self.world_size):
            if rank == self.info.rank:
                continue
            try:
                if self.store.check([keys.heartbeat_key(rank)]):
                    out[rank] = json.loads(self.store.get(keys.heartbeat_key(rank)))["stats"]
            except Exception:  # noqa: BLE001
                pass
        return out

    def scan(self) -> str | None:
        """One look at every other rank; the message naming a dead, failed or hung rank, if any."""
        now = time.time()
        if self.store.check([keys.RUN_OVER]):
            return "the drafters ended the run"
        if self.store.check([keys.ABORT]):  # another rank named the culprit first
            published = json.loads(self.store.get(keys.ABORT))
            self.failed_rank = published["rank"]
            return published["message"]
        for rank in range(self.world_size):
            if rank == self.info.rank:
                continue
            report = self._report(rank)
            if report is not None:
                return report
            if rank in self._finished:
                continue
            if not self.store.check([keys.heartbeat_key(rank)]):
                continue  # not started yet; startup waits are bounded by the process-group timeout
            beat = json.loads(self.store.get(keys.heartbeat_key(rank)))
            info = self.peer(rank)
            gone = info.host == self.info.host and info.pid > 0 and not _pid_alive(info.pid)
            silent = now - beat["time"] > self.timeout_s
            if gone or silent:
                # A rank writes its report (done, or failed) before it exits: one that did so after the look above
                # and then exited is not dead. Looked at again now that it is seen gone, the report is there.
                report = self._report(rank)
                if report is not None:
                    return report
                if rank in self._finished:
                    continue
            self.failed_rank = rank  # provisional: cleared below if this rank looks healthy
            if gone:
                return f"{info.describe()} died (process gone: killed, or crashed without a report)"
            if silent:
                return f"{info.describe()} stopped responding (no heartbeat for {now - beat['time']:.0f} s): killed or lost"
            limit = self.timeout_s if beat.get("warm", True) else self.startup_timeout_s
            if now - beat["progress"] > limit:
                return (f"{info.describe()} is hung (no progress for {now - beat['progress']:.0f} s; "
                        "stuck in a kernel or a collective)")
            self.failed_rank = None
        return None

    def _report(self, rank: int) -> str | None:
        """What ``rank`` reported of its end: the message naming its failure, or None (marked finished when it
        finished)."""
        if self.store.check([keys.fail_key(rank)]):
            cause = json.loads(self.store.get(keys.fail_key(rank)))["cause"]
            self.failed_rank = rank
            return f"{self.peer(rank).describe()} failed: {cause}"
        if self.store.check([keys.done_key(rank)]):
            self._finished.add(rank)
        return None

    def store_lost(self) -> str:
        """The message for a store that no longer answers: it names the node that hosted it and its ranks."""
        hosts = sorted((p for p in self.peers.values() if p.node == STORE_NODE and p.rank != self.info.rank),
                       key=lambda p: p.rank)
        self.failed_rank = hosts[0].rank if hosts else None
        where = f"the job's store at {store_address()} (hosted by node {STORE_NODE}'s launcher"
        if self.info.node == STORE_NODE:
            return (f"lost contact with {where}, this node's own): the launcher on this node stopped (killed, or it "
                    "ended the job: see its log)")
        ranks = ", ".join(p.describe() for p in hosts) if hosts else "ranks this one never heard from"
        return (f"lost contact with {where}, which ran {ranks}): that node died or its network is down "
                f"(or its launcher ended the job: see node {STORE_NODE}'s log)")

    def store_reachable(self) -> bool:
        try:
            self.store.check([keys.RUN_OVER])
            return True
        except Exception:  # noqa: BLE001 - connection refused or reset: the store's host is gone
            return False

    def _local_peer_gone(self) -> bool:
        """Whether a peer on this host has died or is dying (read from /proc: no store traffic)."""
        for rank, info in list(self.peers.items()):
            if rank != self.info.rank and rank not in self._finished and info.host == self.info.host \
                    and info.pid > 0 and not _pid_alive(info.pid):
                return True
        return False

    def _watchdog_loop(self) -> None:
        # The store is scanned every ``beat_s``; peers on this host are looked at every ``poll_s``
        # (a local /proc read), so a killed rank is named well within a second by its neighbours,
        # who publish the message for the ranks of other hosts.
        next_scan = 0.0
        while not self._stop.wait(self.poll_s):
            try:
                if time.time() < next_scan and not self._local_peer_gone():
                    continue
                next_scan = time.time() + self.beat_s
                message = self.scan()
            except Exception:  # noqa: BLE001 - the store itself is gone: its node is lost or its launcher stopped
                if self.store_reachable():
                    continue  # a bad record, not a lost store: look again at the next scan
                message = self.store_lost()
            if message:
                self.abort(message, publish=message != "the drafters ended the run", rank=self.failed_rank)
                return


_PF_EXITING = 0x4  # linux/sched.h: the process is in do_exit
_SIGKILL_BIT = 1 << (9 - 1)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is alive and not on its way out.

    A killed process stays visible for a while: while the kernel tears it down (releasing a large GPU
    context can take many seconds) and then as a zombie until its parent reaps it. Both are dead here.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _dying(pid)


def _dying(pid: int) -> bool:
    """A zombie, a process in exit, or one with a SIGKILL pending (Linux /proc; False elsewhere)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session tty tpgid flags
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING:
        return True
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    return False
