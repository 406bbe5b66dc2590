"""What every rank executes: ``run_training(config)`` (alone for one process, under torchrun otherwise).

It reads top to bottom: config, roles, setup, build and run, finish.

1. config: validated by the caller (``commands.train``); this rank's device; the two models resolved
   once (``spec.ModelSpec``);
2. roles: the process group and the job's store, which rank is target, drafter or both (a pure
   function of the world size, ``roles``), health (heartbeats and the watchdog, ``health``), the
   drafters' groups (``shard``) and the target groups (``target_group``; none with one rank per target);
3. setup: rank 0 decides fresh or resume (``setup``); every rank resolves its ``RunSpec``;
4. build and run: ``line.Line`` builds the role's pieces and runs its loop;
5. finish: the exit code; on failure a message that names the rank and cause (``failure``).

The flow of the line and who waits on whom: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from draftline.checkpoint.writer import wait_for_checkpoint
from draftline.config import TrainConfig, flag_of
from draftline.distributed import rundir
from draftline.distributed.failure import FailureContext, fail
from draftline.distributed.health import Health, local_rank_info
from draftline.distributed.roles import COLOCATED, assign_roles, check_groups_on_nodes, split
from draftline.distributed.setup import agree_on_setup, join_job
from draftline.distributed.shard import make_drafter_group, replicates
from draftline.distributed.signals import StopSignals
from draftline.distributed.target_group import make_target_group
from draftline.errors import DraftlineError
from draftline.model.target_parallel import check_group_size
from draftline.monitor.loggers import NullLogger
from draftline.pipeline.line import Line
from draftline.pipeline.spec import DistEnv, ModelSpec, pick_device, resolve_run
from draftline.sizing.plan import target_share


def run_training(config: TrainConfig) -> int:
    """Run this process's part of the training line; returns the exit code. ``config``: validated
    (``config.validate``, which the command line runs before it launches anything)."""
    # ---- config
    env = DistEnv.from_environ()
    model = ModelSpec.resolve(config)  # configs and tokenizer only: a drafter no engine would serve stops here
    device = pick_device(config, env.local_rank)

    # ---- roles
    store = None
    if env.world_size > 1:
        store = join_job("nccl" if device.type == "cuda" else "gloo", device, rundir.restart_count(),
                         timeout=timedelta(minutes=30))
    t = config.topology
    share = None if t.colocated or t.targets is not None or t.drafters is not None else target_share(model, config)
    num_targets, num_drafters = split(env.world_size, t.targets, t.drafters, share, colocated=t.colocated,
                                      target_parallel=t.target_parallel)
    role = assign_roles(env.world_size, num_targets, num_drafters, colocated=t.colocated,
                        target_parallel=t.target_parallel)[env.rank]
    if t.target_parallel > 1:  # before any weight is read: a group size the target's heads do not divide
        check_group_size(model.target_file_config, t.target_parallel, where=flag_of(t, "target_parallel"))
        check_groups_on_nodes(role, env.local_world_size or env.world_size)
    health = Health(local_rank_info(env.rank, role.kind, device, role.describe_group()), store, env.world_size,
                    timeout_s=t.failure_timeout_s, shared_process=role.kind == COLOCATED)
    health.start()
    # Every rank creates the drafters' groups, then every target group (collective calls, in the same order on
    # every rank), before anything can fail. One rank per target (--target-parallel 1): no target group at all.
    group = make_drafter_group(role.drafter_ranks, role.index, device, health, env.world_size,
                               replicate=replicates(t.drafter_state, device))
    target_group = make_target_group(role, env.rank, device, health)
    signals = StopSignals()

    # ---- setup, build and run
    line: Line | None = None
    code = 0
    cut_short = False  # the line ended by an exception, a clean "the drafters ended the run" too
    try:
        setup = agree_on_setup(config, env.rank, store, health)
        spec, note = resolve_run(config, model, role, env, device, setup)
        line = Line(spec, health, store, group, signals, resume_note=note, target_group=target_group)
        line.run()
    except BaseException as exc:  # noqa: BLE001 - every failure ends here, named
        cut_short = True
        context = line.failure_context() if line is not None else FailureContext(
            health, role, env.world_size, store, Path(config.out), NullLogger(), writes_report=role.is_logging)
        code = fail(exc, context)
        if line is not None:
            line.join_threads()
    finally:
        health.stop()
        if line is not None:
            line.logger.close()

    # ---- finish
    try:  # a periodic checkpoint still being written in the background must not be cut off
        wait_for_checkpoint()
    except DraftlineError as exc:
        print(f"draftline: {exc}", file=sys.stderr, flush=True)
        code = code or 1
    rundir.release_run_lock()  # os._exit below would skip the release at exit
    if env.world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0 or cut_short or target_group is not None:
            # Peers may be dead, or this rank's sender thread still inside a send to drafters that ended the
            # run early (a time limit, a stop), or (a target group's rank) an agreement on a batch still posted that
            # a peer, stopped first, never joins: tearing down the process group could hang or abort.
            os._exit(code)
        dist.destroy_process_group()
    return code
