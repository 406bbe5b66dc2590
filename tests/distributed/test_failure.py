"""The failure handler of one rank: who it names, what it saves, what it writes, its exit code."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from draftline.checkpoint.writer import CheckpointWriteError
from draftline.distributed.failure import FailureContext, fail
from draftline.distributed.health import Health, RankInfo
from draftline.distributed.roles import assign_roles
from draftline.errors import MachineError


class _Log:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def _dead_pid() -> int:
    child = torch.multiprocessing.get_context("spawn").Process(target=os.getpid)
    child.start()
    child.join()
    return child.pid


def _first_of_two_drafters(tmp_path, store):
    """Rank 0, the logging drafter of a 2-drafter + 1-target run whose other drafter (rank 1) has died."""
    roles = assign_roles(3, 1, 2)
    dead = RankInfo(1, "drafter", "here", "CPU", _dead_pid())
    store.set("rank/1", json.dumps(dead.__dict__))
    store.set("hb/1", json.dumps({"time": 0.0, "progress": 0.0, "warm": True, "stats": {}}))
    health = Health(RankInfo(0, "drafter", "here", "CPU", os.getpid()), store, world_size=3, timeout_s=5.0)
    log = _Log()
    return FailureContext(health, roles[0], 3, store, tmp_path, log, step=lambda: 4, writes_report=True), log


def test_a_collective_save_cut_by_a_dead_peer_names_the_peer(tmp_path, capsys):
    """The save's own error (a reset connection) is the echo of the peer's death: the peer is named."""
    ctx, log = _first_of_two_drafters(tmp_path, dist.HashStore())
    exc = CheckpointWriteError("could not write checkpoint step-00000004: RuntimeError: Connection reset by peer")
    assert fail(exc, ctx) == 1
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert "drafter rank 1" in failure["message"] and "died" in failure["message"], failure
    assert "Connection reset by peer" in failure["message"]  # how this rank saw it
    assert failure["step"] == 4 and failure["checkpoint"] is None
    assert "no checkpoint was written before it: start again" in capsys.readouterr().err
    assert log.records[-1]["status"] == "failed"


def test_a_full_disk_is_the_users_to_fix_and_names_no_culprit(tmp_path, capsys):
    ctx, log = _first_of_two_drafters(tmp_path, dist.HashStore())
    assert fail(MachineError("could not write checkpoint x: the disk is full"), ctx) == 1
    err = capsys.readouterr().err
    assert "error (drafter rank 0" in err and "the disk is full" in err and "rank 1" not in err
    assert log.records[-1]["reason"] == "could not write checkpoint x: the disk is full"
