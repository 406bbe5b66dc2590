"""``train --gpus N``: the same command again under torchrun, N local ranks, and its exit code.

The launcher is a process of its own: it sets the environment the ranks inherit (their share of the
cores, sleeping OpenMP threads on CPU, time for a stop's checkpoint), hands the command to torchrun
without the launcher's own flags, and turns how torchrun ended into one message and an exit code
(``postmortem``). A rank started by torchrun dies with its launcher (``die_with_launcher``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from draftline.cores import usable_cores
from draftline.distributed.postmortem import name_failed_rank, stopped_exit_code

LAUNCHER_FLAGS = ("--gpus", "--nproc", "--max-restarts")
"""The launcher's own flags (each with a value): not passed on to the ranks, which must not launch again."""


def cpu_launch_env(device: str) -> None:
    """CPU ranks share the cores: OpenMP threads that spin while they wait take the CPU from the
    rank that has work (measured on 2 cores, 2 targets + 1 drafter: 1.27 -> 1.88 drafter batches/s).
    Waiting threads sleep instead, unless the user chose a policy."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def threads_per_rank(num_processes: int) -> int:
    """OpenMP threads of each of ``num_processes`` ranks on this node: its cores shared out, so the
    ranks do not oversubscribe them (torchrun would set 1, and print a banner saying so)."""
    return max(1, usable_cores() // max(1, num_processes))


def launch_env(device: str, num_processes: int) -> None:
    """The environment the launched ranks inherit; a variable the user set stays."""
    cpu_launch_env(device)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(num_processes)))
    # On SIGINT/SIGTERM torchrun passes the signal on and waits this long before it kills the ranks:
    # long enough for the step in flight and the stop's checkpoint (torchrun's default is 30 s).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")


def rank_argv(argv: list[str]) -> list[str]:
    """``argv`` without the launcher's own flags and their values."""
    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in LAUNCHER_FLAGS:
            skip = True
            continue
        if item.startswith(tuple(f"{flag}=" for flag in LAUNCHER_FLAGS)):
            continue
        rest.append(item)
    return rest


def launch(gpus: int, max_restarts: int, argv: list[str], out: str, device: str) -> int:
    """Re-run ``draftline train argv`` under torchrun with ``gpus`` local processes (a config file's
    topology.gpus reaches the ranks too; they run under torchrun, so they do not launch again)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launch_env(device, gpus)
    torchrun_args = ["--standalone", f"--nproc-per-node={gpus}", f"--max-restarts={max_restarts}",
                     "-m", "draftline", "train", *rank_argv(argv)]
    started = time.time()
    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        code = first.exitcode
        culprit = name_failed_rank(Path(out), rank, first, started)
        print(f"draftline: the run failed: {culprit} (see the ranks' messages above)", file=sys.stderr)
        return code if code and code > 0 else 1
    except SignalException as exc:  # torchrun passed the signal to the ranks and waited for them
        return stopped_exit_code(Path(out), exc.sigval, started)
    return 0


def die_with_launcher() -> None:
    """A rank started by torchrun dies with its launcher (Linux): if a node's torchrun is killed, its
    ranks would otherwise train on as orphans nobody stops, and the other nodes could not see that
    the node is gone. Dead, they are named by the surviving ranks like any rank that died."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)
