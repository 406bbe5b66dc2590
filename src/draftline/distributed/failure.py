"""A failed rank's last words: name the failure and its culprit, save what can be saved, the exit code.

Every exception of a rank ends in ``fail``. A user-fixable ``DraftlineError`` is reported as is
(exit 2; a ``MachineError``, such as a full disk, exit 1). Otherwise the rank looks for a culprit: a
communication error here (in a collective checkpoint's write too) is usually the echo of another
rank's death, which the watchdog names (``Health.scan``). With one drafter, the drafter saves a
checkpoint of its last completed step; with several (a checkpoint is written by all of them together,
and a dead one's part is gone) the newest periodic checkpoint is the one to resume from, and the
message says which. The first drafter writes ``RUN_DIR/failure.json``, the second one when the first
is the rank that died.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftline import run_files
from draftline.checkpoint.state import latest_checkpoint
from draftline.checkpoint.writer import settle_checkpoint_write
from draftline.distributed import keys
from draftline.distributed.health import Health, RunAborted, describe_exception
from draftline.distributed.memory import find_out_of_memory
from draftline.distributed.roles import Role
from draftline.errors import DraftlineError, MachineError


@dataclass
class FailureContext:
    """What the failure handler of a rank may use: everything else it is not told about."""

    health: Health
    role: Role
    world_size: int
    store: object | None
    run_dir: Path
    logger: object
    step: Callable[[], int | None] = lambda: None
    """The last completed step (None before the drafter exists, and on targets)."""
    save: Callable[[], Path] | None = None
    """Saves a checkpoint of the last completed step (the one drafter of an unsharded run; else None)."""
    writes_report: bool = False
    """This rank writes failure.json and the end record (the first drafter)."""
    stands_in: bool = False
    """This rank writes them instead when the first drafter is the one that died (the second drafter)."""


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
        return store.check([keys.RUN_OVER])
    except Exception:  # noqa: BLE001 - the store is gone: not a clean stop
        return False


def fail(exc: BaseException, ctx: FailureContext) -> int:
    """Name the failure, save what can be saved, return the exit code."""
    health = ctx.health
    health.handling_failure()  # this rank's main thread is here, not stuck in a collective
    if isinstance(exc, DraftlineError):
        # Something the user can fix (config, data, memory): say it plainly; peers name this rank.
        health.report_failure(str(exc))
        where = f" ({health.info.describe()})" if ctx.world_size > 1 else ""
        print(f"draftline train: error{where}: {exc}", file=sys.stderr, flush=True)
        if ctx.writes_report:
            _log_end(ctx, str(exc))
        return 1 if isinstance(exc, MachineError) else 2
    if not isinstance(exc, RunAborted) and not ctx.role.is_drafter and ctx.store is not None and _run_over(ctx.store):
        # A target's error after the drafters ended the run is the echo of that end (a rank of a target group whose
        # peer stopped in the middle of their agreement): a clean stop, as a wait that saw it.
        return 0
    if isinstance(exc, RunAborted):
        message = str(exc)
    else:
        cause = describe_exception(exc)
        # A communication error is usually the echo of another rank's death; running out of memory is not.
        own = find_out_of_memory(exc) is not None
        culprit = find_culprit(health) if ctx.store is not None and not own else None
        if culprit:
            message = f"{culprit} (seen by {health.info.describe()} as: {cause[:200]})"
            health.abort(message, publish=True, rank=health.failed_rank)
        else:
            health.report_failure(cause)
            message = health.aborted
    if isinstance(exc, RunAborted) and ctx.store is not None and _run_over(ctx.store):
        return 0  # the drafters ended the run while this rank waited: a clean stop
    reports = ctx.writes_report or (ctx.stands_in and health.failed_rank == ctx.role.drafter_rank(0))
    if ctx.role.is_logging or ctx.world_size == 1:
        print(f"\ndraftline: run failed: {message}", file=sys.stderr, flush=True)
    else:
        print(f"draftline: {health.info.describe()}: stopping: {message}", file=sys.stderr, flush=True)
    unfinished = settle_checkpoint_write()  # a save the failure cut short: not kept, and said so
    if unfinished is not None:
        print(f"draftline: {unfinished}", file=sys.stderr, flush=True)
    saved = None
    if ctx.save is not None:
        try:
            saved = ctx.save()
            print(f"draftline: checkpoint of the last completed step ({ctx.step()}) saved to {saved}; "
                  "fix the cause and run the same command with --resume", file=sys.stderr, flush=True)
        except BaseException as save_exc:  # noqa: BLE001
            print(f"draftline: could not save a checkpoint: {describe_exception(save_exc)}", file=sys.stderr)
    elif reports and ctx.role.num_drafters > 1:
        newest = latest_checkpoint(ctx.run_dir, quiet=True)
        print("draftline: with several drafters a checkpoint is written by all of them together, so none is written "
              "after a failure; "
              + (f"resume from the newest one, {newest}, with the same command and --resume" if newest else
                 "no checkpoint was written before it: start again"), file=sys.stderr, flush=True)
        saved = newest
    if reports:
        try:
            (ctx.run_dir / run_files.FAILURE).write_text(json.dumps(
                {"time": time.time(), "message": message, "step": ctx.step(),
                 "checkpoint": str(saved) if saved else None}, indent=2) + "\n")
        except OSError:
            pass
        _log_end(ctx, message)
    return 1


def _log_end(ctx: FailureContext, reason: str) -> None:
    try:
        ctx.logger.log({"kind": "end", "time": time.time(), "elapsed_s": 0.0, "step": ctx.step(),
                        "status": "failed", "reason": reason})
    except Exception:  # noqa: BLE001 - a full disk must not hide the message above
        pass
