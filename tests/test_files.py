"""A disk that fills while the run's files are written: metrics.jsonl, TensorBoard, the trace, the report,
an export (and a checkpoint's drafter, whose safetensors error wraps the OSError).

The full disk is simulated where the bytes are written: ``os.write`` into a file under the full folder
writes what still fits and then raises ENOSPC, as a real disk does; TensorBoard's writer thread opens its
files through ``io.open``, and safetensors writes from Rust (raising its own error around the OS's).
Each case: a ``MachineError`` naming the path, the free bytes and the fix, exit 1 from the command without
a traceback, and nothing half-written left that looks whole. The last test does the same on a real
64-KiB tmpfs where user namespaces allow one.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from draftline.checkpoint import export as export_module
from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.writer import _write_error
from draftline.cli import main
from draftline.errors import MachineError
from draftline.evaluate.report import write_report
from draftline.files import append_line, open_for_append, write_atomic
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.monitor.loggers import JsonlLogger, TensorBoardLogger
from draftline.monitor.live import write_trace
from helpers import namespaces_work

FULL = r"the disk is full \(No space left on device\): [\d.]+ [MG]iB free on "


class Disk:
    """Files under ``folder`` get ``room`` more bytes, then ENOSPC (``room=None``: no limit)."""

    def __init__(self, monkeypatch, folder: Path):
        self.folder, self.room = folder.resolve(), None
        real_write, real_open = os.write, io.open

        def under(path) -> bool:
            return self.folder in Path(path).resolve().parents

        def take(wanted: int) -> int:
            if self.room is None:
                return wanted
            given = min(wanted, self.room)
            if given == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= given
            return given

        def write(fd, data):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return real_write(fd, data)
            return real_write(fd, bytes(data)[:take(len(data))]) if under(path) else real_write(fd, data)

        class Filling(io.RawIOBase):  # a file opened through io.open under the folder
            def __init__(self, file):
                self.file = file

            def write(self, data):
                return self.file.write(bytes(data)[:take(len(data))])

            def writable(self):
                return True

            def close(self):
                self.file.close()
                super().close()

        def open_(file, mode="r", *args, **kwargs):
            opened = real_open(file, mode, *args, **kwargs)
            named = isinstance(file, (str, bytes, os.PathLike))  # TensorBoard names its files in bytes
            return Filling(opened) if named and set(mode) & set("wax") and under(os.fsdecode(file)) else opened

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(io, "open", open_)


def _no_leftovers(folder: Path) -> None:
    assert not [p.name for p in folder.rglob(".*tmp*")], list(folder.rglob("*"))


def test_a_metrics_record_goes_on_whole_or_not_at_all(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    logger = JsonlLogger(tmp_path / "run" / "metrics.jsonl")
    logger.log({"kind": "train", "step": 1, "loss": 2.5})
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    disk.room = 10  # the next record fits in part
    with pytest.raises(MachineError, match=r"could not write a metrics record to \S+metrics.jsonl: " + FULL) as caught:
        logger.log({"kind": "train", "step": 2, "loss": 2.25, "accuracy_by_position": [0.5] * 7})
    assert "free space there" in str(caught.value) and "this one was not kept" in str(caught.value)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before  # no half line
    disk.room = None  # room again: the run's next record follows the last whole one
    logger.log({"kind": "train", "step": 3, "loss": 2.0})
    logger.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 3]


def test_a_trace_record_goes_on_whole_or_not_at_all(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    write_trace(tmp_path / "trace", "steps.jsonl", {"step": 1, "loss": 3.0})
    disk.room = 5
    with pytest.raises(MachineError, match=r"could not write a trace record to \S+trace/steps.jsonl: " + FULL):
        write_trace(tmp_path / "trace", "steps.jsonl", {"step": 2, "loss": 2.0})
    assert (tmp_path / "trace" / "steps.jsonl").read_text() == json.dumps({"step": 1, "loss": 3.0}) + "\n"


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no traceback from its thread
def test_tensorboard_on_a_full_disk_is_named(tmp_path, monkeypatch):
    disk = Disk(monkeypatch, tmp_path)
    logger = TensorBoardLogger(tmp_path / "tensorboard")
    logger.log({"kind": "train", "step": 1, "loss": 2.5})
    disk.room = 0
    with pytest.raises(MachineError, match=r"could not write TensorBoard events to \S+tensorboard/events.out.tfevents.*: "
                                           + FULL + r".*--no-tensorboard"):
        logger.log({"kind": "train", "step": 2, "loss": 2.0})


def test_an_other_error_than_a_full_disk_is_raised_as_it_is(tmp_path, monkeypatch):
    def broken(fd, data):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    fd = open_for_append(tmp_path / "x.jsonl")
    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError, match="Input/output error"):
        append_line(fd, "{}\n", tmp_path / "x.jsonl", "a record to", "fix")
    with pytest.raises(OSError, match="Input/output error"):
        write_atomic(tmp_path / "y.md", b"text", "the summary", "fix")
    assert not (tmp_path / "y.md").exists()
    _no_leftovers(tmp_path)


def _run_with_metrics(run: Path) -> Path:
    logger = JsonlLogger(run / "metrics.jsonl")
    logger.log({"kind": "start", "time": 1.7e9, "elapsed_s": 0.0, "mode": "fresh", "step": 0,
                "config": {"model": {"target": "t"}}})
    for step in range(1, 6):
        logger.log({"kind": "train", "time": 1.7e9 + step, "elapsed_s": step, "step": step, "loss": 3.0 / step,
                    "accuracy_by_position": [0.5 / k for k in range(1, 8)], "ktok_s": 1.0})
    logger.close()
    return run


def test_a_report_on_a_full_disk_keeps_the_one_before_and_exits_1(tmp_path, monkeypatch, capsys):
    run = _run_with_metrics(tmp_path / "run")
    write_report(run)
    before = {p.name: p.read_bytes() for p in (run / "report").iterdir()}
    assert "summary.md" in before and "loss.png" in before
    disk = Disk(monkeypatch, run / "report")
    disk.room = len(before["loss.png"]) + 1000  # the first plot fits, the second not
    assert main(["report", str(run)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"could not write the plot {run / 'report' / 'accuracy_by_position.png'}: " in err
    assert "the accuracy_by_position.png from before is as it was" in err and "run `draftline report` again" in err
    after = {p.name: p.read_bytes() for p in (run / "report").iterdir()}
    assert after.keys() == before.keys() and after["accuracy_by_position.png"] == before["accuracy_by_position.png"]
    assert after["summary.md"] == before["summary.md"]  # not rewritten: the report stopped at the full disk

    shutil.rmtree(run / "report")  # a first report: nothing of a file that did not fit is left
    (run / "report").mkdir()
    disk.room = 1000
    assert main(["report", str(run)]) == 1
    assert "could not write the plot" in capsys.readouterr().err
    assert list((run / "report").iterdir()) == []


def _drafter(target_dir) -> DFlashDrafter:
    config = build_drafter_config(load_target_config(target_dir), num_hidden_layers=1, block_size=4,
                                  target_layer_ids=[1, 4])
    torch.manual_seed(0)
    return DFlashDrafter(config).float()


def test_an_export_on_a_full_disk_writes_nothing_and_exits_1(qwen3_target, tmp_path, monkeypatch, capsys):
    save_drafter(_drafter(qwen3_target), tmp_path / "drafter", dtype=torch.float32)
    save_file = export_module.save_file

    def filling(tensors, path, metadata=None):  # safetensors' own error, as a real full disk raises it
        Path(path).write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export_module, "save_file", filling)
    out = tmp_path / "exports" / "drafter"
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(qwen3_target)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"could not write the drafter {out}: the disk is full (No space left on device)" in err
    assert "nothing of it was kept" in err and "free space there" in err
    assert list((tmp_path / "exports").iterdir()) == []  # no drafter, no temporary directory

    monkeypatch.setattr(export_module, "save_file", save_file)  # an export from before stays as it was
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(qwen3_target)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(export_module, "save_file", filling)
    assert main(["export", str(tmp_path / "drafter"), str(out), "--target", str(qwen3_target)]) == 1
    assert f"the {out} from before is as it was" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in (tmp_path / "exports").iterdir()] == ["drafter"]


def test_a_checkpoint_s_drafter_on_a_full_disk_is_named_as_a_full_disk():
    """safetensors' error around ENOSPC (its weights are the checkpoint's last big file) is the disk's, not a bug's."""
    error = _write_error(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                         None, None)
    assert isinstance(error, MachineError) and "the disk is full (No space left on device)" in str(error)


def test_on_a_real_full_disk_export_and_report_say_so(qwen3_target, tmp_path):
    if not namespaces_work(tmp_path):
        pytest.skip("needs unshare with user and mount namespaces (a tmpfs of a given size)")
    save_drafter(_drafter(qwen3_target), tmp_path / "drafter", dtype=torch.float32)  # ~0.4 MiB in bf16
    run = _run_with_metrics(tmp_path / "run")
    disk = tmp_path / "disk"
    disk.mkdir()
    (run / "report").mkdir()
    draftline = shlex.join([sys.executable, "-m", "draftline"])
    script = (f"mount -t tmpfs -o size=64k tmpfs {disk} && mount -t tmpfs -o size=48k tmpfs {run / 'report'} || exit 99; "
              f"{draftline} export {tmp_path / 'drafter'} {disk / 'out'} --target {qwen3_target}; echo EXIT=$?; "
              f"ls -A {disk}; echo LISTED; {draftline} report {run}; echo EXIT=$?; ls -A {run / 'report'}")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.stdout.count("EXIT=1") == 2, out[-3000:]
    assert "Traceback" not in out
    assert f"could not write the drafter {disk / 'out'}: the disk is full" in done.stderr
    assert done.stdout.split("EXIT=1", 1)[1].split("LISTED")[0].split() == []  # nothing left on the full disk
    assert "could not write the plot" in done.stderr and "the disk is full" in done.stderr
    listed = done.stdout.rsplit("EXIT=1", 1)[1].split()
    assert not [name for name in listed if "tmp" in name], listed
