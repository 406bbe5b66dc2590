"""What every rank executes: ``run_training(config)`` (alone for one process, under torchrun otherwise).

It reads top to bottom: config, roles, build, run.

1. config: validated; the device of this rank;
2. roles: the process group and the job's store, which rank is target, drafter or both (a pure
   function of the world size, ``roles``), health (heartbeats and the watchdog, ``health``);
3. build and run: ``line.Line`` agrees on the setup with rank 0, builds the role's pieces and runs
   its loop;
4. finish: the exit code; on failure a message that names the rank and cause (``failure``).

The flow of the line and who waits on whom: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from draftline.checkpoint.state import wait_for_checkpoint
from draftline.config import TrainConfig, validate
from draftline.errors import DraftlineError
from draftline.monitor.flops import DrafterShape, TargetShape, reference_drafter_flops, reference_target_flops
from draftline.pipeline import rundir
from draftline.pipeline.build import DistEnv, drafter_config, pick_device
from draftline.pipeline.health import Health, local_rank_info
from draftline.pipeline.line import Line
from draftline.pipeline.roles import COLOCATED, assign_roles, split
from draftline.pipeline.setup import job_store


def run_training(config: TrainConfig) -> int:
    """Run this process's part of the training line; returns the exit code."""
    # ---- config
    validate(config)
    env = DistEnv.from_environ()
    device = pick_device(config, env.local_rank)

    # ---- roles
    store = None
    if env.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
        store = job_store(rundir.restart_count())
    colocated = config.topology.colocated
    num_targets, num_drafters = split(env.world_size, config.topology.targets, config.topology.drafters,
                                      None if colocated else _target_share(config), colocated=colocated)
    role = assign_roles(env.world_size, num_targets, num_drafters, colocated=colocated)[env.rank]
    health = Health(local_rank_info(env.rank, role.kind, device), store, env.world_size,
                    timeout_s=config.topology.failure_timeout_s)
    health.shared_process = role.kind == COLOCATED
    # All ranks create the drafters' group (a collective call), before anything can fail.
    drafter_group = dist.new_group(role.drafter_ranks) if env.world_size > 1 and num_drafters > 1 else None

    # ---- build and run
    line = Line(config, env, device, role, health, store, drafter_group=drafter_group)
    health.start()
    code = 0
    try:
        line.run()
    except BaseException as exc:  # noqa: BLE001 - every failure ends here, named
        code = line.fail(exc)
    finally:
        health.stop()
        line.logger.close()

    # ---- finish
    try:  # a periodic checkpoint still being written in the background must not be cut off
        wait_for_checkpoint()
    except DraftlineError as exc:
        print(f"draftline: {exc}", file=sys.stderr, flush=True)
        code = code or 1
    if env.world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0:
            os._exit(code)  # peers may be dead: tearing down the process group could hang
        dist.destroy_process_group()
    return code


def _target_share(config: TrainConfig) -> float | None:
    """The target's share of the work per sample (FLOP model), to balance a default split."""
    if config.topology.targets is not None or config.topology.drafters is not None:
        return None
    try:
        from draftline.model.target import load_target_config

        drafter_cfg = drafter_config(config)
        target_shape = TargetShape.from_config(load_target_config(config.model.target))
        drafter_shape = DrafterShape.from_config(drafter_cfg)
        if config.optim.distill > 0:
            drafter_shape = dataclasses.replace(drafter_shape, teacher_layers=target_shape.num_layers)
        t = reference_target_flops(target_shape, drafter_shape.target_layers_run)
        d = reference_drafter_flops(drafter_shape, num_anchors=config.data.max_anchors)
        return t / (t + d)
    except Exception:  # noqa: BLE001 - fall back to an even split
        return None
