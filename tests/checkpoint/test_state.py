"""Training checkpoints: written in the background from a host copy, verified on resume, a failed
write (a full disk) never touches the previous checkpoint and is never lost."""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from draftline.checkpoint import state as ckpt_state
from draftline.checkpoint import writer as ckpt
from draftline.checkpoint.locate import find_drafter_dir
from draftline.checkpoint.state import TrainerState, latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from draftline.checkpoint.writer import wait_for_checkpoint
from draftline.config import OptimConfig
from draftline.errors import DraftlineError, MachineError
from draftline.model.config import build_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import load_target_config
from draftline.pipeline.optim import build_optimizer, build_scheduler


@pytest.fixture()
def trainer(qwen3_target):
    """A tiny drafter with an AdamW state (one step taken) and its scheduler."""
    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float()
    optimizer = build_optimizer(drafter, OptimConfig())
    scheduler = build_scheduler(optimizer, OptimConfig(), total_steps=10)
    sum(p.float().pow(2).sum() for p in drafter.parameters()).backward()
    optimizer.step()
    scheduler.step()
    yield drafter, optimizer, scheduler
    try:  # a test that leaves a failed write behind must not fail the next one
        wait_for_checkpoint()
    except DraftlineError:
        pass


def _save(run_dir, trainer, step, **kwargs):
    drafter, optimizer, scheduler = trainer
    state = TrainerState(step=step, next_seq=step * 2, in_flight=[], counters={"tokens": step}, config={"step": step})
    return save_checkpoint(run_dir, drafter=drafter, optimizer=optimizer, scheduler=scheduler, state=state, keep=3, **kwargs)


def _weights(drafter):
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def test_round_trip_with_a_manifest(trainer, tmp_path):
    drafter, optimizer, scheduler = trainer
    path = _save(tmp_path, trainer, 5, wait=True)
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"trainer.pt", "trainer.json", "drafter/model.safetensors", "drafter/config.json",
            "state/.metadata"} <= set(manifest["files"])
    assert any(name.startswith("state/") and name.endswith(".distcp") for name in manifest["files"])
    assert verify_checkpoint(path) is None and latest_checkpoint(tmp_path) == path
    expected = _weights(drafter)
    moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1.0)
    optimizer.state.clear()
    restored = load_checkpoint(path, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
    assert restored.step == 5 and restored.counters == {"tokens": 5}
    for name, value in _weights(drafter).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    for key, value in optimizer.state_dict()["state"].items():
        torch.testing.assert_close(value["exp_avg"], moments[key], rtol=0, atol=0)


def test_save_returns_before_the_write_and_keeps_the_state_of_the_call(trainer, tmp_path, monkeypatch):
    drafter = trainer[0]
    release, writing = threading.Event(), threading.Event()
    real_write = ckpt._finish

    def slow_write(*args):
        writing.set()
        assert release.wait(30)
        return real_write(*args)

    monkeypatch.setattr(ckpt, "_finish", slow_write)
    expected = _weights(drafter)
    started = time.perf_counter()
    path = _save(tmp_path, trainer, 1)
    assert writing.wait(10) and time.perf_counter() - started < 5  # returned while the write is held
    assert not path.exists()
    with torch.no_grad():  # training goes on and changes the weights while the write waits
        for p in drafter.parameters():
            p.mul_(-3.0)

    second_returned = threading.Event()  # at most one write in flight: the next save waits
    threading.Thread(target=lambda: (_save(tmp_path, trainer, 2), second_returned.set()), daemon=True).start()
    time.sleep(0.5)
    assert not second_returned.is_set()
    release.set()
    assert second_returned.wait(30)
    assert wait_for_checkpoint() == ckpt.checkpoint_dir(tmp_path, 2)
    from draftline.checkpoint.export import load_drafter

    saved = load_drafter(path / "drafter").state_dict()
    for name, value in saved.items():  # step 1 holds the weights at its call, not the later ones
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_an_error_in_the_writer_is_raised_on_the_training_thread(trainer, tmp_path, monkeypatch):
    good = _save(tmp_path, trainer, 1, wait=True)

    def broken(*_args, **_kwargs):
        raise RuntimeError("the storage went away")

    monkeypatch.setattr(ckpt, "save_file", broken)
    _save(tmp_path, trainer, 2)  # returns; the failure happens in the background
    # Not the storage (an OSError would be): a failure of the run (a peer that died mid-save), not the user's.
    with pytest.raises(ckpt.CheckpointWriteError, match=r"could not write checkpoint .*step-00000002: "
                                                        r"RuntimeError: the storage went away.*step-00000001 is whole"):
        _save(tmp_path, trainer, 3)  # ... and is raised at the next save
    monkeypatch.undo()
    _save(tmp_path, trainer, 4, wait=True)
    monkeypatch.setattr(ckpt, "save_file", broken)
    _save(tmp_path, trainer, 5)
    with pytest.raises(ckpt.CheckpointWriteError, match="the storage went away"):
        wait_for_checkpoint()  # ... or at the end of training
    assert latest_checkpoint(tmp_path) == ckpt.checkpoint_dir(tmp_path, 4) and good.is_dir()


def test_a_storage_error_in_the_writer_is_the_machines(trainer, tmp_path, monkeypatch):
    _save(tmp_path, trainer, 1, wait=True)

    def refused(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpt, "save_file", refused)
    _save(tmp_path, trainer, 2)
    with pytest.raises(MachineError, match=r"step-00000002: PermissionError: .*Permission denied.*"
                                           r"step-00000001 is whole"):
        wait_for_checkpoint()


def test_a_full_disk_leaves_the_previous_checkpoint_whole(trainer, tmp_path, monkeypatch):
    previous = _save(tmp_path, trainer, 1, wait=True)
    before = {p.name: p.read_bytes() for p in previous.rglob("*") if p.is_file()}
    real_save = torch.save

    def disk_fills(obj, path, *args, **kwargs):  # half of trainer.pt reaches the disk, then ENOSPC
        if not isinstance(path, (str, Path)):  # DCP's own serialisation into memory
            return real_save(obj, path, *args, **kwargs)
        real_save(obj, path, *args, **kwargs)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_fills)
    with pytest.raises(DraftlineError, match=r"could not write checkpoint .*step-00000002: the disk is full .*: "
                                             r"[\d.]+ [MG]iB free on .*checkpoints, and a checkpoint takes about "
                                             r"[\d.]+ [MG]iB; .*step-00000001 is whole and --resume continues from it; "
                                             r"free space"):
        _save(tmp_path, trainer, 2, wait=True)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-00000001"]  # no half checkpoint, no temp dir
    assert (folder / "latest").read_text().strip() == "step-00000001"
    assert {p.name: p.read_bytes() for p in previous.rglob("*") if p.is_file()} == before
    assert verify_checkpoint(previous) is None and latest_checkpoint(tmp_path) == previous


@pytest.mark.parametrize("damage, reason", [
    ("truncate", r"trainer\.pt has [\d,]+ bytes, the manifest says [\d,]+ \(truncated\?\)"),
    ("flip", r"drafter/model\.safetensors does not match its checksum \(corrupt\)"),
    ("no_manifest_no_weights", r"no manifest\.json and no drafter/model\.safetensors"),
])
def test_a_damaged_latest_checkpoint_is_skipped_on_resume(trainer, tmp_path, capsys, damage, reason):
    first = _save(tmp_path, trainer, 1, wait=True)
    second = _save(tmp_path, trainer, 2, wait=True)
    if damage == "truncate":
        data = (second / "trainer.pt").read_bytes()
        (second / "trainer.pt").write_bytes(data[: len(data) // 3])
    elif damage == "flip":
        weights = second / "drafter" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (second / "manifest.json").unlink()
        (second / "drafter" / "model.safetensors").unlink()
    ckpt_state._VERIFIED.clear()
    with pytest.raises(DraftlineError, match=rf"step-00000002: checkpoint is not whole \({reason}\)"):
        load_checkpoint(second, drafter=trainer[0], optimizer=trainer[1], scheduler=trainer[2])
    # eval/export pass over a damaged drafter (a cut trainer.pt leaves the drafter usable)
    assert find_drafter_dir(tmp_path) == (second if damage == "truncate" else first) / "drafter"
    assert latest_checkpoint(tmp_path) == first
    err = capsys.readouterr().err
    assert f"checkpoint {second} is not whole" in err and "moved to corrupt-step-00000002" in err
    assert (tmp_path / "checkpoints" / "corrupt-step-00000002").is_dir() and not second.exists()
    load_checkpoint(first, drafter=trainer[0], optimizer=trainer[1], scheduler=trainer[2])


def test_a_write_cut_by_a_crash_is_invisible_and_cleaned_up(trainer, tmp_path):
    first = _save(tmp_path, trainer, 1, wait=True)
    stale = tmp_path / "checkpoints" / ".tmp-step-00000002-abc"
    stale.mkdir()
    (stale / "trainer.pt").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == first
    _save(tmp_path, trainer, 3, wait=True)
    assert not stale.exists()  # pruned with the next save


def test_a_save_while_handling_a_failure_is_on_disk_when_it_returns(trainer, tmp_path, monkeypatch):
    """The failure path saves, then the process may end with os._exit: that save must not be left to the thread."""
    release = threading.Event()
    real_write = ckpt._finish
    monkeypatch.setattr(ckpt, "_finish", lambda *args: (release.wait(0.5), real_write(*args))[1])
    try:
        raise RuntimeError("a rank died")
    except RuntimeError:
        path = _save(tmp_path, trainer, 7)
        assert verify_checkpoint(path) is None  # written before save_checkpoint returned
