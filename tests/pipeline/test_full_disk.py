"""A disk that fills in the middle of a run (a real one: a small tmpfs in a private mount namespace).

The run says the disk is full (the path, the free bytes, a checkpoint's size), keeps the previous checkpoint
whole, exits 1 without an abort, and ``--resume`` continues from that checkpoint once there is room; before
training it already warned that the disk cannot hold the checkpoints it keeps.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from helpers import namespaces_work
from line_helpers import ENV, base_args

pytestmark = pytest.mark.slow


def test_a_full_disk_is_named_keeps_the_previous_checkpoint_exits_1_and_resume_continues(qwen3_target, line_data,
                                                                                         tmp_path):
    if not namespaces_work(tmp_path):
        pytest.skip("needs unshare with user and mount namespaces (a tmpfs of a given size)")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "run"
    args = base_args(qwen3_target, line_data, out, save_every=3, keep=1, random_init=True)
    train = shlex.join([sys.executable, "-m", "draftline", "train", *args])
    # 1200 KiB: the first checkpoint of this drafter (~0.6 MiB) fits, the next (written before the first goes) not.
    script = (f"mount -t tmpfs -o size=1200k tmpfs {disk} || exit 99; {train}; echo EXIT=$?; "
              f"ls {out / 'checkpoints'}; mount -o remount,size=64m {disk}; {train} --resume; echo EXIT=$?")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], env=ENV,
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    codes = [int(c) for c in re.findall(r"EXIT=(\d+)", done.stdout)]
    assert codes == [1, 0], text[-4000:]
    assert "the disk is full" in text and "Aborted" not in text and "terminate called" not in text
    message = next(line for line in done.stderr.splitlines() if "the disk is full" in line)
    assert re.search(r"[\d.]+ [KMG]iB free on \S+checkpoints, and a checkpoint takes about [\d.]+ [KMG]iB", message)
    kept = re.search(r"the previous checkpoint (\S+step-(\d+)) is whole and --resume continues from it", message)
    assert kept, message
    assert f"step-{kept.group(2)}" in done.stdout  # listed after the failure: it is still there
    assert f"resume run in {out} from {kept.group(1)}" in done.stdout
    assert "finished at step" in done.stdout
    assert "checkpoints will fail" in done.stdout  # the warning before training
