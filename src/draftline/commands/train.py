"""``draftline train``: targets -> hidden-state queue -> drafters.

One GPU (or CPU): ``draftline train --target DIR --data DATA --out RUN`` runs target and drafter
in one process. One node: ``draftline train --gpus 8 ...`` (or ``torchrun --nproc-per-node 8 -m
draftline train ...``). Many nodes: ``torchrun`` as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from draftline.config_flags import add_config_arguments, config_from_args
from draftline.cores import usable_cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every config field's option (``draftline.config_flags``), grouped by config section, and the launcher's."""
    parser.description = (
        "Train a DFlash drafter: targets -> hidden-state queue -> drafters. Every option below is also a field "
        "of a TOML or JSON config file (--config; the flag overrides the file), shown after its text as "
        "[section] field."
    )
    groups = add_config_arguments(parser)
    groups["topology"].add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="with --gpus: times torchrun restarts the whole job after a rank fails; each restart resumes from the "
             "latest checkpoint (a command-line option only; default: 0)")


def _cpu_launch_env(device: str) -> None:
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


def _launch_env(device: str, num_processes: int) -> None:
    """The environment the launched ranks inherit; a variable the user set stays."""
    _cpu_launch_env(device)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(num_processes)))
    # On SIGINT/SIGTERM torchrun passes the signal on and waits this long before it kills the ranks:
    # long enough for the step in flight and the stop's checkpoint (torchrun's default is 30 s).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")


def _launch(gpus: int, max_restarts: int, argv: list[str], out: str, device: str) -> int:
    """Re-run this command under torchrun with ``gpus`` local processes (a config file's
    topology.gpus reaches the ranks too; they run under torchrun, so they do not launch again)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _launch_env(device, gpus)

    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--gpus", "--nproc", "--max-restarts"):
            skip = True
            continue
        if item.startswith(("--gpus=", "--nproc=", "--max-restarts=")):
            continue
        rest.append(item)
    torchrun_args = ["--standalone", f"--nproc-per-node={gpus}", f"--max-restarts={max_restarts}",
                     "-m", "draftline", "train", *rest]
    started = time.time()
    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        code = first.exitcode
        culprit = _name_failed_rank(Path(out), rank, first, started)
        print(f"draftline: the run failed: {culprit} (see the ranks' messages above)", file=sys.stderr)
        return code if code and code > 0 else 1
    except SignalException as exc:  # torchrun passed the signal to the ranks and waited for them
        return _stopped(Path(out), exc.sigval, started)
    return 0


def _stopped(run_dir: Path, signum: int, started: float) -> int:
    """The exit code of a launch stopped by a signal, from how its ranks ended: the logging rank's
    end record in RUN_DIR/metrics.jsonl (its message, with the checkpoint, is above)."""
    end = _last_end_record(run_dir / "metrics.jsonl", started)
    if end is not None and end.get("status") in ("stopped", "finished"):
        return 0
    if end is not None and end.get("status") == "failed":
        return 1
    name = signal.Signals(signum).name
    print(f"draftline: stopped by {name} before the run saved a checkpoint of its stop; --resume continues "
          "from the latest checkpoint, if there is one", file=sys.stderr)
    return 128 + int(signum)


def _last_end_record(path: Path, since: float) -> dict | None:
    """The last ``kind: "end"`` record written at or after ``since`` (read from the file's tail)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "end" and record.get("time", 0) >= since:
            return record
    return None


def _name_failed_rank(run_dir: Path, rank: int, failure, started: float) -> str:
    """The first rank torchrun saw fail, named from its record in RUN_DIR/ranks (role, host, GPU, pid).

    torchrun may notice a killed rank and stop the others before their watchdogs name it; then this
    is the only place that can, so it also writes RUN_DIR/failure.json if no rank did.
    """
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    name = f"rank {rank} (pid {failure.pid})"
    record = run_dir / "ranks" / f"rank-{rank}.json"
    try:
        info = json.loads(record.read_text())
        name = f"{info['role']} rank {rank} (host {info['host']}, {info['gpu']}, pid {info['pid']})"
    except (OSError, ValueError, KeyError):
        pass
    message = f"{name} died ({how})"
    failure_json = run_dir / "failure.json"
    try:
        written = json.loads(failure_json.read_text())["time"] >= started  # by a rank of this launch
    except (OSError, ValueError, KeyError):
        written = False
    if written:  # a rank's watchdog named the culprit; it may have stopped the others before torchrun saw it
        return json.loads(failure_json.read_text())["message"]
    from draftline.pipeline.rundir import live_owner

    if run_dir.is_dir() and not written and live_owner(run_dir) is None:  # not into another live run's directory
        failure_json.write_text(json.dumps({"time": time.time(), "message": message, "step": None,
                                            "checkpoint": None}, indent=2) + "\n")
    return message


def _die_with_launcher() -> None:
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


def run(args: argparse.Namespace) -> int:
    from draftline.pipeline.signals import handlers_kept

    with handlers_kept():  # called in a process that goes on (tests): its own handlers back at the end
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from draftline.pipeline.signals import interrupt_until_training

    interrupt_until_training()  # a stop before the line handles signals: a message, not a traceback
    from draftline.config import validate
    from draftline.errors import DraftlineError
    from draftline.pipeline.run import run_training

    config = config_from_args(args)
    validate(config)
    gpus = config.topology.gpus  # --gpus, or topology.gpus of a config file
    if args.max_restarts < 0:
        raise DraftlineError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.max_restarts and not (gpus and gpus > 1 and "LOCAL_RANK" not in os.environ):
        raise DraftlineError("--max-restarts needs --gpus N (or topology.gpus) > 1: it is torchrun's restart count; "
                             "a job started by torchrun itself takes torchrun's own --max-restarts")
    if gpus and gpus > 1 and "LOCAL_RANK" not in os.environ:
        from draftline.pipeline.rundir import check_run_dir_free

        check_run_dir_free(config.out)  # refused before any rank starts; rank 0 takes the lock itself
        return _launch(gpus, args.max_restarts, list(getattr(args, "argv", sys.argv[2:])), config.out,
                       config.topology.device)
    _die_with_launcher()
    return run_training(config)
