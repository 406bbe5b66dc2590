"""The start of a run that every rank must agree on, decided once by rank 0.

Rank 0 decides fresh or resume (``rundir``), prepares the run directory and checks the dataset;
it publishes the answer (or its error) in the job's store, where the other ranks wait for it while
their watchdog runs. Nothing else crosses between ranks before training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch.distributed as dist

from draftline.config import TrainConfig
from draftline.pipeline import rundir
from draftline.pipeline.build import resolve_data_dir
from draftline.pipeline.health import Health, RunAborted, describe_exception
from draftline.pipeline.waits import wait_for


def job_store(restart: int):
    """A client of the job's store (torchrun's), under a prefix private to this start of the job."""
    store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(f"draftline/{restart}/", store)


@dataclass
class RunSetup:
    mode: str  # "fresh", "resume" or "restart"
    checkpoint: str | None  # the checkpoint to resume from
    start_step: int
    data_dir: str  # the prepared dataset


def decide_setup(config: TrainConfig) -> RunSetup:
    """Rank 0's part: fresh or resume, the run directory, the dataset."""
    rundir.acquire_run_lock(config.out)  # one live run per directory: refused here, named, if another owns it
    decision = rundir.decide_start(config)
    rundir.prepare_run_dir(config, decision)
    data_dir = resolve_data_dir(config)
    checkpoint = decision.checkpoint
    start_step = int(checkpoint.name.split("-")[-1]) if checkpoint else 0
    return RunSetup(decision.mode, str(checkpoint) if checkpoint else None, start_step, str(data_dir))


def agree_on_setup(config: TrainConfig, rank: int, store, health: Health) -> RunSetup:
    """Every rank gets rank 0's ``RunSetup``; an error on rank 0 raises ``RunAborted`` on the others."""
    if rank == 0:
        try:
            setup = decide_setup(config)
        except BaseException as exc:
            if store is not None:
                store.set("setup_error", describe_exception(exc))
            raise
        if store is not None:
            store.set("setup", json.dumps(asdict(setup)))
        return setup
    wait_for(lambda: store.check(["setup"]) or store.check(["setup_error"]), health, max_sleep_s=0.05)
    if not store.check(["setup"]):
        raise RunAborted(f"rank 0 could not set the run up: {store.get('setup_error').decode()}")
    return RunSetup(**json.loads(store.get("setup")))
