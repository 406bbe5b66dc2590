"""The start of a run that every rank must agree on, decided once by rank 0.

Rank 0 decides fresh or resume (``rundir``), prepares the run directory, checks the dataset and, on
a resume, reads the checkpoint's step and batches per optimizer step (a resume keeps them whatever
its number of drafters); it publishes the answer (or its error) in the job's store, where the other
ranks wait for it while their watchdog runs. Nothing else crosses between ranks before training.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from draftline import run_files
from draftline.checkpoint.state import read_trainer_state
from draftline.config import TrainConfig, default_loss
from draftline.data.dataset import META_FILE
from draftline.distributed import keys, rundir
from draftline.distributed.health import Health, RunAborted, describe_exception
from draftline.distributed.waits import wait_for
from draftline.errors import DraftlineError


def join_job(backend: str, device, restart: int, timeout: timedelta) -> dist.Store:
    """Join the job's default process group; returns a client of the job's store private to this start.

    torchrun keeps one store for the whole job, across its restarts: every key this start writes (the
    process groups' addresses included, which torch names the same in every start) goes under a prefix
    of the restart count, so a restarted job never reads the address of a process of the start before.
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(keys.start_prefix(restart), store), rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return dist.PrefixStore(keys.JOB_PREFIX, dist.distributed_c10d._get_default_store())


@dataclass
class RunSetup:
    mode: str  # "fresh", "resume" or "restart"
    checkpoint: str | None  # the checkpoint to resume from
    start_step: int
    data_dir: str  # the prepared dataset
    batches_per_step: int | None = None  # the checkpoint's (None: a fresh start's, from the config)
    checkpoint_drafters: int | None = None  # how many drafters wrote the checkpoint
    balance_steps: bool | None = None  # the checkpoint's data.balance_steps (None: fresh, or written before the option)
    moments: str | None = None  # the checkpoint's optim.moments (None: fresh, or written before the option: fp32)
    loss: str | None = None  # the checkpoint's loss weights (None: fresh, or not known: a DFlash run's default)


def resolve_data_dir(config: TrainConfig) -> Path:
    """The prepared dataset to train on: ``--data`` itself.

    Preparing is its own step (``draftline prepare``), before the line starts: no rank of a
    training run tokenizes. Anything else is refused with the exact command that prepares it.
    """
    sources = [Path(p) for p in config.data.data]
    if len(sources) == 1 and (sources[0] / META_FILE).is_file():
        return sources[0]
    out = Path(config.out) / run_files.DATA
    command = shlex.join([
        "draftline", "prepare", "--target", str(config.model.target), "--input", *map(str, sources), "--out", str(out),
        "--max-length", str(config.data.max_length or config.data.token_budget),
        "--heldout", str(config.monitor.eval_num_prompts), "--seed", str(config.data.seed),
    ])
    what = "is not a prepared dataset (no meta.json)" if len(sources) == 1 else "are not one prepared dataset"
    raise DraftlineError(f"--data {' '.join(map(str, sources))} {what}; prepare it first, then train with "
                         f"--data {out}:\n  {command}")


def decide_setup(config: TrainConfig) -> RunSetup:
    """Rank 0's part: the dataset, fresh or resume, the run directory, the checkpoint's step and batches per step."""
    data_dir = resolve_data_dir(config)  # an unprepared dataset is refused before the run directory is touched
    rundir.acquire_run_lock(config.out)  # one live run per directory: refused here, named, if another owns it
    decision = rundir.decide_start(config)
    rundir.prepare_run_dir(config, decision)
    checkpoint = decision.checkpoint
    if checkpoint is None:
        return RunSetup(decision.mode, None, 0, str(data_dir))
    state = read_trainer_state(checkpoint)
    return RunSetup(decision.mode, str(checkpoint), state.step, str(data_dir), state.batches_per_step,
                    state.num_drafters, state.config.get("data", {}).get("balance_steps"),
                    state.config.get("optim", {}).get("moments"), saved_loss(state.config))


def saved_loss(saved: dict) -> str | None:
    """The loss weights a checkpoint's run trained with (``config.resolved_loss``), from its saved config; None where
    that is not known: a DFlash run that left the loss to its default, which was 'dflash' before it became 'dpace'."""
    method, loss = saved.get("model", {}).get("method"), saved.get("optim", {}).get("loss")
    if loss is None and method != "dspark":
        return None
    return default_loss(method, loss)


def agree_on_setup(config: TrainConfig, rank: int, store, health: Health) -> RunSetup:
    """Every rank gets rank 0's ``RunSetup``; an error on rank 0 raises ``RunAborted`` on the others."""
    if rank == 0:
        try:
            setup = decide_setup(config)
        except BaseException as exc:
            if store is not None:
                store.set(keys.SETUP_ERROR, describe_exception(exc))
            raise
        if store is not None:
            store.set(keys.SETUP, json.dumps(asdict(setup)))
        return setup
    wait_for(lambda: store.check([keys.SETUP]) or store.check([keys.SETUP_ERROR]), health, max_sleep_s=0.05)
    if not store.check([keys.SETUP]):
        raise RunAborted(f"rank 0 could not set the run up: {store.get(keys.SETUP_ERROR).decode()}")
    return RunSetup(**json.loads(store.get(keys.SETUP)))
