"""A failed rank's last words: name the failure and its culprit, save what can be saved, exit code.

Every exception of a rank ends in ``fail``. A user-fixable ``DraftlineError`` is reported as is
(exit 2). Otherwise the rank looks for a culprit: a communication error here is usually the echo of
another rank's death, which the watchdog names (``Health.scan``). The logging drafter (or, if it is
the one that died, the next drafter) saves a checkpoint of the last completed step and writes
``RUN_DIR/failure.json``.
"""

from __future__ import annotations

import json
import sys
import time

from draftline.errors import DraftlineError
from draftline.pipeline.health import Health, RunAborted, describe_exception
from draftline.pipeline.memory import find_out_of_memory


def find_culprit(health: Health, wait_s: float = 3.0) -> str | None:
    """Another rank's death or failure report, if one shows within ``wait_s``; a store that no longer
    answers names the node that hosted it (this rank's own error is then only the echo of that loss)."""
    end = time.time() + wait_s
    while time.time() < end:
        try:
            found = health.scan()
        except Exception:  # noqa: BLE001 - the store itself is gone, or a blip: look once more
            time.sleep(0.2)
            return None if health.store_reachable() else health.store_lost()
        if found and found != "the drafters ended the run":
            return found
        time.sleep(0.2)
    return None


def _run_over(store) -> bool:
    try:
        return store.check(["run_over"])
    except Exception:  # noqa: BLE001 - the store is gone: not a clean stop
        return False


def fail(line, exc: BaseException) -> int:
    """Name the failure of ``line`` (a ``line.Line``), save what can be saved, return the exit code."""
    health, worker = line.health, line.worker
    if isinstance(exc, DraftlineError):
        # Something the user can fix (config, data, memory): say it plainly; peers name this rank.
        health.report_failure(str(exc))
        where = f" ({health.info.describe()})" if line.env.world_size > 1 else ""
        print(f"draftline train: error{where}: {exc}", file=sys.stderr, flush=True)
        if line.role.is_logging and worker is not None:
            line.logger.log({"kind": "end", "time": time.time(), "elapsed_s": 0.0, "step": worker.step,
                             "status": "failed", "reason": str(exc)})
        return 2
    if isinstance(exc, RunAborted):
        message = str(exc)
    else:
        cause = describe_exception(exc)
        # A communication error is usually the echo of another rank's death; running out of memory is not.
        own = find_out_of_memory(exc) is not None
        culprit = find_culprit(health) if line.store is not None and not own else None
        if culprit:
            message = f"{culprit} (seen by {health.info.describe()} as: {cause[:200]})"
            health.abort(message, publish=True, rank=health.failed_rank)
        else:
            health.report_failure(cause)
            message = health.aborted
    clean_stop = isinstance(exc, RunAborted) and line.store is not None and _run_over(line.store)
    if clean_stop:
        return 0
    if line.role.is_logging or line.env.world_size == 1:
        print(f"\ndraftline: run failed: {message}", file=sys.stderr, flush=True)
    else:
        print(f"draftline: {health.info.describe()}: stopping: {message}", file=sys.stderr, flush=True)
    # The logging drafter saves; if it is the rank that died, the next drafter does.
    role = line.role
    saver = role.is_logging or (role.is_drafter and role.index == 1 and health.failed_rank == 0)
    if saver and worker is not None and not worker.in_optimizer_step:
        try:
            worker.settle(notify=False)  # the last step's record (read one step late) and its update, queued
            path = line.save_checkpoint()
            print(f"draftline: checkpoint of the last completed step ({worker.step}) saved to {path}; "
                  "fix the cause and run the same command with --resume", file=sys.stderr, flush=True)
        except BaseException as save_exc:  # noqa: BLE001
            print(f"draftline: could not save a checkpoint: {describe_exception(save_exc)}", file=sys.stderr)
    if saver:
        try:
            (line.run_dir / "failure.json").write_text(json.dumps(
                {"time": time.time(), "message": message, "step": worker.step if worker else None,
                 "checkpoint": str(line.saved) if line.saved else None}, indent=2) + "\n")
            line.logger.log({"kind": "end", "time": time.time(), "elapsed_s": 0.0,
                             "step": worker.step if worker else None, "status": "failed", "reason": message})
        except OSError:
            pass
    return 1
