"""The run directory: who owns it, is this a fresh start or a resume, and the record of every start.

``RUN_DIR/run.lock`` names the one live run that owns the directory (host, pid, start time): a
second start into it, with any flags, is refused naming that run; a lock left by a dead run is
taken over with a message (``acquire_run_lock``). ``RUN_DIR/config.json`` holds the resolved config;
``RUN_DIR/starts.jsonl`` one line per start (fresh, resume, or a torchrun restart) so nobody has to
guess what a directory holds. Starting over a directory that has checkpoints needs
``--from-scratch``, which moves the old run aside instead of deleting it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from draftline import run_files
from draftline.config import TrainConfig
from draftline.errors import DraftlineError



@dataclass
class StartDecision:
    mode: str  # "fresh", "resume" or "restart" (torchrun restarted the job)
    checkpoint: Path | None


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def decide_start(config: TrainConfig) -> StartDecision:
    """What to do with RUN_DIR given --resume / --from-scratch (pure apart from reading the dir)."""
    # Here, not at the top: the launcher imports this module for the run lock alone, before any rank starts,
    # and the checkpoint code brings torch and transformers (~2 s).
    from draftline.checkpoint.state import latest_checkpoint

    run_dir = Path(config.out)
    latest = latest_checkpoint(run_dir) if run_dir.exists() else None
    restarted = restart_count() > 0
    if config.checkpoint.resume or restarted:
        if latest is None:
            if restarted:
                return StartDecision("restart", None)
            raise DraftlineError(
                f"{run_dir}: --resume, but there is no checkpoint to resume from; drop --resume to start a new run"
            )
        return StartDecision("restart" if restarted else "resume", latest)
    if latest is not None and not config.checkpoint.from_scratch:
        raise DraftlineError(
            f"{run_dir} already holds a run (latest checkpoint {latest.name}); pass --resume to continue it "
            "or --from-scratch to start over (the old run is moved aside, not deleted)"
        )
    return StartDecision("fresh", None)


def prepare_run_dir(config: TrainConfig, decision: StartDecision) -> None:
    """Create RUN_DIR; on a fresh start over an old run, move the old run's files aside."""
    run_dir = Path(config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    if decision.mode == "fresh" and config.checkpoint.from_scratch:
        present = [name for name in run_files.MOVED_ASIDE if (run_dir / name).exists()]
        if present:
            aside = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for name in present:
                shutil.move(str(run_dir / name), str(aside / name))
            print(f"draftline: --from-scratch: moved the previous run's {', '.join(present)} to {aside}")
    (run_dir / run_files.CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def record_start(run_dir: str | Path, entry: dict[str, Any]) -> None:
    """Append this start (fresh or resume, from which step) to RUN_DIR/starts.jsonl."""
    path = Path(run_dir) / run_files.STARTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def log_start(config: TrainConfig, decision: StartDecision, *, step: int, world_size: int, topology: dict) -> None:
    record_start(
        config.out,
        {
            "time": time.time(),
            "mode": decision.mode,
            "from_checkpoint": str(decision.checkpoint) if decision.checkpoint else None,
            "step": step,
            "restart_count": restart_count(),
            "world_size": world_size,
            "topology": topology,
            "host": socket.gethostname(),
        },
    )


# ---------------------------------------------------------------------------------------------------
# One live run per directory: RUN_DIR/run.lock
#
# Rank 0 creates the lock (O_EXCL) before it decides fresh or resume, refreshes its mtime every
# HEARTBEAT_S from a thread, and removes it at exit. A start that finds the lock asks whether its
# owner still runs: on this host the pid answers (with its start time, so a reused pid is not taken
# for the run, and the boot id, for a lock older than a reboot); a torchrun restart of the same job
# (same TORCHELASTIC_RUN_ID, a later restart count) takes over its previous attempt's lock; on
# another host only the heartbeat can tell, and a lock not refreshed for STALE_S is a dead run's.

HEARTBEAT_S = 15.0
STALE_S = 120.0
_UNREADABLE_GRACE_S = 10.0  # a lock being written is empty for a moment; an older unreadable one is debris


@dataclass(frozen=True)
class LockOwner:
    """Who holds a run directory: what ``RUN_DIR/run.lock`` holds."""

    host: str
    pid: int
    pid_start: str | None  # the process's start time (clock ticks since boot, /proc): a reused pid differs
    boot_id: str | None  # this boot of the host (/proc): a lock older than a reboot is dead
    started: float  # Unix time the lock was taken
    run_id: str  # TORCHELASTIC_RUN_ID ("" outside torchrun): kept by a torchrun restart of the job
    restart: int  # TORCHELASTIC_RESTART_COUNT of the attempt that took the lock
    token: str  # this acquisition

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        job = f", torchrun job {self.run_id} attempt {self.restart}" if self.run_id else ""
        return f"host {self.host}, pid {self.pid}, started {when}{job}"


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of ``pid`` from /proc, or None where /proc cannot tell (no such pid, not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces
    return fields[0], fields[19]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def this_process() -> LockOwner:
    """The owner this process would write into a lock."""
    stat = _proc_stat(os.getpid())
    return LockOwner(host=socket.gethostname(), pid=os.getpid(), pid_start=stat[1] if stat else None,
                     boot_id=_boot_id(), started=time.time(), run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
                     restart=restart_count(), token=uuid.uuid4().hex)


def _pid_runs(owner: LockOwner) -> bool:
    """Whether the lock's process still runs on this host (not merely a reused pid or a zombie)."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _proc_stat(owner.pid)
    if stat is None:
        return True  # no /proc: the pid is all there is to go on
    state, start = stat
    return state != "Z" and (owner.pid_start is None or start == owner.pid_start)


def judge_owner(owner: LockOwner, age_s: float, me: LockOwner) -> tuple[str, str]:
    """Is the lock's owner alive, from ``me``'s point of view: ``(verdict, why)``, the verdict one of
    "mine" (this process), "restart" (an earlier attempt of this torchrun job), "dead", "stale" or "live"."""
    if owner.run_id and owner.run_id == me.run_id and owner.restart < me.restart:
        return "restart", f"attempt {owner.restart} of this torchrun job (this is attempt {me.restart})"
    if owner.host == me.host:
        if owner.boot_id and me.boot_id and owner.boot_id != me.boot_id:
            return "dead", "the host has rebooted since"
        if owner.pid == me.pid and owner.pid_start == me.pid_start:
            return "mine", "this process"
        if not _pid_runs(owner):
            return "dead", "that process no longer runs"
        return "live", "that process runs on this host"
    if age_s > STALE_S:
        return "stale", f"not refreshed for {age_s:.0f} s (a live run refreshes it every {HEARTBEAT_S:.0f} s)"
    return "live", f"refreshed {age_s:.0f} s ago from host {owner.host}"


def read_lock(path: Path) -> tuple[LockOwner | None, float]:
    """The lock's owner (None if it cannot be read) and the seconds since it was last refreshed.

    Both from one open file: a takeover replaces the lock between two looks at its path, and the new
    owner must not be judged by the old file's age."""
    try:
        with path.open("rb") as f:
            age = max(0.0, time.time() - os.fstat(f.fileno()).st_mtime)
            text = f.read()
    except FileNotFoundError:
        raise
    except OSError:
        try:
            return None, max(0.0, time.time() - path.stat().st_mtime)
        except OSError:
            return None, 0.0
    try:
        return LockOwner(**json.loads(text)), age
    except (ValueError, TypeError):
        return None, age


def _lock_text(owner: LockOwner) -> str:
    return json.dumps(asdict(owner), indent=2) + "\n"


def _create(path: Path, me: LockOwner) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(_lock_text(me))
    return True


def _take_over(path: Path, judged: str | None, me: LockOwner) -> bool:
    """Replace the lock judged dead (token ``judged``) by ours, unless another start got there first.

    A second file, created with O_EXCL, makes the check and the replacement one step: of two
    starts that judged the same dead lock, one replaces it and the other then finds a live owner.
    """
    guard = path.with_name(run_files.LOCK + ".takeover")
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - guard.stat().st_mtime > 30:  # left by a start that died in these lines
                guard.unlink()
        except OSError:
            pass
        time.sleep(0.1)
        return False
    try:
        try:
            owner, _ = read_lock(path)
        except FileNotFoundError:
            owner = None
        if (owner.token if owner else None) != judged:
            return False
        tmp = path.with_name(f"{run_files.LOCK}.{me.token}")
        tmp.write_text(_lock_text(me))
        os.replace(tmp, path)  # atomic: the directory is never without a lock
        return True
    finally:
        os.close(fd)
        guard.unlink(missing_ok=True)


def _refusal(run_dir: Path, owner: LockOwner, why: str) -> DraftlineError:
    path = run_dir / run_files.LOCK
    hint = ("" if owner.host == socket.gethostname() else
            f"; if host {owner.host} is down, the lock counts as a dead run's {STALE_S:.0f} s after its last refresh "
            f"(or delete {path})")
    return DraftlineError(
        f"{run_dir} belongs to a live run ({owner.describe()}; {why}): a second run would write into the same "
        f"checkpoints. Stop that run first (SIGINT or SIGTERM: it saves a checkpoint) and --resume it, or train "
        f"into another --out{hint}"
    )


class RunLock:
    """This process's hold on RUN_DIR/run.lock; ``release`` gives it up (also at exit)."""

    def __init__(self, run_dir: Path, owner: LockOwner, created_dir: bool):
        self.run_dir = run_dir
        self.path = run_dir / run_files.LOCK
        self.owner = owner
        self.created_dir = created_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="draftline-run-lock", daemon=True)
        self._thread.start()

    def holds(self) -> bool:
        try:
            owner, _ = read_lock(self.path)
        except FileNotFoundError:
            return False
        return owner is not None and owner.token == self.owner.token

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.holds():
                    print(f"draftline: warning: {self.path} no longer names this run (another start took it over, "
                          "judging this one dead): two runs may now write into this directory", file=sys.stderr)
                    return
                os.utime(self.path)
            except OSError:
                pass  # a file system blip: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        try:
            if self.holds():
                self.path.unlink()
            if self.created_dir:
                self.run_dir.rmdir()  # only if empty: a start refused before it wrote anything
        except OSError:
            pass


_held: RunLock | None = None


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Make this process the owner of ``run_dir`` (rank 0, before ``decide_start``), or raise
    ``DraftlineError`` naming the live run that owns it. A dead owner's lock is taken over with a
    message. Released by ``release_run_lock`` or at exit."""
    global _held
    release_run_lock()  # a run before this one in the same process is over
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    me = this_process()
    take_lock(run_dir, me)
    _held = RunLock(run_dir, me, created)
    if not getattr(acquire_run_lock, "_at_exit", False):
        atexit.register(release_run_lock)
        acquire_run_lock._at_exit = True
    return _held


def take_lock(run_dir: Path, me: LockOwner, timeout_s: float = 30.0) -> None:
    """Write ``me`` into ``run_dir``'s lock: created if there is none, taken over (with a message) from
    a dead owner, refused (``DraftlineError``) while a live one holds it."""
    path = run_dir / run_files.LOCK
    deadline = time.time() + timeout_s
    while not _create(path, me):
        try:
            owner, age = read_lock(path)
        except FileNotFoundError:
            continue  # released between our two looks
        if owner is None:
            if age < _UNREADABLE_GRACE_S and time.time() < deadline:
                time.sleep(0.1)  # being written by another start
                continue
            verdict, why = "dead", "it cannot be read"
        else:
            verdict, why = judge_owner(owner, age, me)
        if verdict == "live":
            raise _refusal(run_dir, owner, why)
        if _take_over(path, owner.token if owner else None, me):
            if verdict != "mine":
                left_by = owner.describe() if owner else "an unknown run"
                print(f"draftline: {path} was left by a run that has ended ({left_by}; {why}): "
                      "this run takes it over", file=sys.stderr, flush=True)
            return
        if time.time() > deadline:
            raise DraftlineError(f"{path}: could not take the run directory's lock (other starts keep taking it); "
                                 "is another run starting into this directory?")


def release_run_lock() -> None:
    """Give up this process's run directory lock, if it holds one (the end of the run, before exit)."""
    global _held
    if _held is not None:
        _held.release()
        _held = None


def live_owner(run_dir: str | Path) -> tuple[LockOwner, str] | None:
    """The live run that owns ``run_dir`` other than this process, with why it counts as live; None
    if the directory is free or its lock is a dead run's. For a launcher's check before it starts ranks."""
    path = Path(run_dir) / run_files.LOCK
    try:
        owner, age = read_lock(path)
    except FileNotFoundError:
        return None
    if owner is None:
        return None
    verdict, why = judge_owner(owner, age, this_process())
    return (owner, why) if verdict == "live" else None


def check_run_dir_free(run_dir: str | Path) -> None:
    """Raise the refusal ``acquire_run_lock`` would, without taking the lock (the ``--gpus`` launcher)."""
    found = live_owner(run_dir)
    if found is not None:
        raise _refusal(Path(run_dir), *found)
