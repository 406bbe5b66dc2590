"""Two nodes on one machine: two torchrun launchers on localhost (CPU, gloo, c10d rendezvous)
running the README's multi-node command. It trains; killing one node's launcher stops the other
node with a message that names the lost rank (role, rank, host, pid) and a non-zero exit; killing the
launcher that hosts the job's store (node 0's) makes the other node name that node and its ranks,
not blame itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from line_helpers import ENV, base_args, read_jsonl, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _node(node_rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d ... -m draftline train ...`` (README form)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--max-restarts", "0", "-m", "draftline", "train", "--targets", "1", "--drafters", "1", *args]
    return subprocess.Popen(command, env=ENV, stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"),
                            start_new_session=True)


def _two_nodes(tmp_path, args) -> list[subprocess.Popen]:
    port = _free_port()
    first = _node(0, port, args, tmp_path / "node0")
    # Node 0 first, so that its launcher hosts the rendezvous store (the --rdzv-endpoint's host).
    wait_until(lambda: _listening(port), 60, "node 0's launcher to listen", first)
    return [first, _node(1, port, args, tmp_path / "node1")]


def _workers(launcher_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == launcher_pid:
                pids.append(int(entry))
    return pids


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_nodes_train_and_a_killed_launcher_stops_the_other_naming_the_lost_rank(qwen3_target, line_data, tmp_path):
    # 1. it trains: both nodes finish, one drafter saved
    out = tmp_path / "run"
    (tmp_path / "a").mkdir()
    procs = _two_nodes(tmp_path / "a", base_args(qwen3_target, line_data, out, max_steps=4))
    try:
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        _stop(procs)
    assert codes == [0, 0], (tmp_path / "a" / "node0.err").read_text()[-3000:]
    assert (out / "final" / "model.safetensors").is_file()
    assert {r["role"] for r in (json.loads(p.read_text()) for p in (out / "ranks").glob("rank-*.json"))} == {"target", "drafter"}

    # 2. node 1's launcher is killed (SIGKILL, its rank is not touched): node 0 stops, naming the rank it lost
    out = tmp_path / "run2"
    (tmp_path / "b").mkdir()
    procs = _two_nodes(tmp_path / "b", base_args(qwen3_target, line_data, out, epochs=40, max_steps=400, trace=True,
                                                 failure_timeout=5))
    try:
        wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 3, 90, "3 steps", procs[0])
        lost = _workers(procs[1].pid)
        assert len(lost) == 1
        killed_at = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)
        code = procs[0].wait(timeout=60)
        seconds = time.time() - killed_at
    finally:
        _stop(procs)
    err = (tmp_path / "b" / "node0.err").read_text()
    info = next(json.loads(p.read_text()) for p in (out / "ranks").glob("rank-*.json") if json.loads(p.read_text())["pid"] == lost[0])
    assert code != 0 and seconds < 30, err[-3000:]
    named = f"{info['role']} rank {info['rank']} (host {info['host']}, CPU, pid {lost[0]})"
    assert named in err and "died" in err, err[-3000:]
    assert named in json.loads((out / "failure.json").read_text())["message"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_losing_the_node_that_hosts_the_store_is_named_by_the_survivor(qwen3_target, line_data, tmp_path):
    out = tmp_path / "run"
    procs = _two_nodes(tmp_path, base_args(qwen3_target, line_data, out, epochs=40, max_steps=400, trace=True,
                                           failure_timeout=5))
    try:
        wait_until(lambda: len(read_jsonl(out / "trace" / "steps.jsonl")) >= 3, 90, "3 steps", procs[0])
        ranks = [json.loads(p.read_text()) for p in (out / "ranks").glob("rank-*.json")]
        host = next(r for r in ranks if r["node"] == 0)  # torchrun's group rank 0: its launcher serves the store
        survivor = next(r for r in ranks if r["node"] != 0)
        launcher = _parent(host["pid"])
        victim, other = (0, 1) if procs[0].pid == launcher else (1, 0)
        assert procs[victim].pid == launcher
        killed_at = time.time()
        os.kill(launcher, signal.SIGKILL)
        code = procs[other].wait(timeout=60)
        seconds = time.time() - killed_at
    finally:
        _stop(procs)
    err = (tmp_path / f"node{other}.err").read_text()
    assert code != 0 and seconds < 30, err[-3000:]
    lost = f"{host['role']} rank {host['rank']} (host {host['host']}, CPU, pid {host['pid']})"
    named = [line for line in err.splitlines() if "lost contact with the job's store at" in line]
    assert named, err[-3000:]
    assert re.search(r"store at \S+:\d+ \(hosted by node 0's launcher, which ran " + re.escape(lost) + r"\): "
                     r"that node died or its network is down", named[0]), named[0]
    me = f"{survivor['role']} rank {survivor['rank']} (host"
    assert named[0].startswith(f"draftline: {me}") or "run failed:" in named[0], named[0]
    assert f"{me} {survivor['host']}, CPU, pid {survivor['pid']}) failed" not in err, err[-3000:]  # not itself
