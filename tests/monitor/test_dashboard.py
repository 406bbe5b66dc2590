"""The panel, the plain log line, the live display and the balance advice."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from draftline.monitor.dashboard import Dashboard, balance_advice, render_panel, status_line


def _text(renderable) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_panel_shows_the_numbers(busy_status):
    text = _text(render_panel(busy_status))
    for expected in ("step 1,234/10,000", "epoch 2/6", "ETA 1h02m", "20.2", "7.14", "312", "39.6%",
                     "989 TFLOP/s", "spec dense bf16", "49.7% of ceiling", "788 TFLOP/s", "3/50 12/50", "0/20", "1.25 batches/s",
                     "wait 35%", "drafters wait 35% of the time", "2.3456", "0.412", "tau 1.87 (eval @1200)", "tf-acc 3.21", "6.00e-04",
                     "skipped 2", "82 71 60 --", "61.2/139.8 GiB", "97%", "drafter", "n/a", "SM clock",
                     "1,755/1,980 MHz, power cap"):
        assert expected in text, expected


def test_plain_mode_prints_one_line_per_update(busy_status):
    out = io.StringIO()
    dashboard = Dashboard(Console(file=out, width=80), live=False)
    dashboard.update(busy_status)
    dashboard.update(dataclasses.replace(busy_status, step=1235))
    dashboard.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("MFU against peak 989 TFLOP/s")  # the peak and its source, once
    assert len(lines) == 3
    assert lines[1].startswith("step 1,234/10,000") and lines[2].startswith("step 1,235/10,000")
    for expected in ("20.2 Ktok/s", "MFU 39.6%", "q_hs 0/20", "drafters 1.10 b/s wait 35%", "loss 2.3456",
                     "tau 1.87 (eval @1200) tf-acc 3.21", "ETA 1h02m", "--targets 3 --drafters 5",
                     "[0:target 61.2/139.8 GiB 97% 1,755/1,980 MHz, power cap]"):
        assert expected in lines[1], expected
    assert status_line(busy_status) == lines[1]


def test_a_window_that_compiled_says_so_and_one_that_did_not_is_silent(busy_status):
    assert "compiled" not in status_line(busy_status) and "compiled" not in _text(render_panel(busy_status))
    compiling = dataclasses.replace(busy_status, compile_s=95.0, compiling_s=22.4)
    assert "| compiled 22 s | ETA 1h02m" in status_line(compiling)
    assert "compiled 22 s since the last status" in _text(render_panel(compiling))


def test_live_mode_on_a_terminal(busy_status):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with Dashboard(console) as dashboard:
        assert dashboard.live
        dashboard.update(busy_status)
        dashboard.update(dataclasses.replace(busy_status, ktok_s=21.7))
    assert "21.7" in out.getvalue()


def test_advice_when_drafters_wait(busy_status):
    advice = balance_advice(busy_status)
    assert advice == "drafters wait 35% of the time (q_hs empty): --targets 3 --drafters 5, or raise --max-anchors"


def test_advice_when_targets_wait(busy_status):
    status = dataclasses.replace(busy_status, target_wait=0.4, drafter_wait=0.01, q_hs=20)
    advice = balance_advice(status)
    assert advice == "targets wait 40% of the time (q_hs full): --targets 1 --drafters 7, or lower --max-anchors"


def test_advice_moves_target_ranks_by_whole_groups(busy_status):
    """Targets split over groups of 2 (--target-parallel 2): the advice moves a whole group."""
    status = dataclasses.replace(busy_status, num_targets=4, num_drafters=4, target_parallel=2)
    assert "--targets 6 --drafters 2" in balance_advice(status)
    waiting = dataclasses.replace(status, target_wait=0.4, drafter_wait=0.01, q_hs=20)
    assert "--targets 2 --drafters 6" in balance_advice(waiting)
    assert "add drafter ranks" in balance_advice(dataclasses.replace(waiting, num_targets=2, num_drafters=6))


def test_advice_when_targets_wait_on_data(busy_status):
    status = dataclasses.replace(busy_status, target_wait=0.4, drafter_wait=0.3, q_hs=2, q_pre=[0, 0])
    assert balance_advice(status).startswith("both sides wait")
    status = dataclasses.replace(status, drafter_wait=0.05)
    assert "data loading is the bottleneck" in balance_advice(status)


def test_advice_when_balanced_or_unknown(busy_status):
    assert balance_advice(dataclasses.replace(busy_status, target_wait=0.03, drafter_wait=0.05)).startswith("balanced")
    assert balance_advice(dataclasses.replace(busy_status, target_wait=float("nan"))) == "no waiting figures yet"


def test_tau_is_the_measured_one_and_says_when_there_is_none(busy_status):
    """tau is speculative decoding's; the teacher-forced figure is labelled tf-acc, never tau."""
    before_eval = dataclasses.replace(busy_status, tau=float("nan"), tau_step=None)
    line = status_line(before_eval)
    assert "tau n/a (no eval yet)" in line and "tf-acc 3.21" in line and "tau 3.21" not in line
    assert "tau n/a (no eval yet)" in _text(render_panel(before_eval))


# ------------------------------------------------------------------ advice that fits the layout

_WAITS = {"targets wait (q_hs full)": dict(target_wait=0.6, drafter_wait=0.01, q_hs=20),
          "drafters wait (q_hs empty)": dict(target_wait=0.01, drafter_wait=0.6, q_hs=0),
          "targets wait on data": dict(target_wait=0.6, drafter_wait=0.01, q_hs=2, q_pre=[0, 0]),
          "both wait": dict(target_wait=0.6, drafter_wait=0.6),
          "balanced": dict(target_wait=0.02, drafter_wait=0.03)}


def _split_in(advice: str) -> tuple[int, int] | None:
    import re

    found = re.search(r"--targets (\d+) --drafters (\d+)", advice)
    return (int(found[1]), int(found[2])) if found else None


def test_every_advice_fits_a_colocated_layout(busy_status):
    """One process, or N colocated ranks: there is no split to move ranks across."""
    for num_ranks in (1, 4):
        for name, waits in _WAITS.items():
            status = dataclasses.replace(busy_status, colocated=True, num_targets=num_ranks, num_drafters=num_ranks,
                                         **waits)
            advice = balance_advice(status)
            for wrong in ("add drafter", "add target", "--targets", "--drafters", "--max-anchors"):
                assert wrong not in advice, (num_ranks, name, advice)
    status = dataclasses.replace(busy_status, colocated=True, num_targets=1, num_drafters=1, **_WAITS[
        "targets wait (q_hs full)"])
    assert balance_advice(status).startswith("colocated: the target waits 60% of the time while its drafter computes")


def test_every_advice_fits_a_split_layout(busy_status):
    """T targets + D drafters: a rank moved to the slower side, the world size kept, no side emptied."""
    for targets, drafters in ((1, 1), (2, 1), (1, 2), (3, 5)):
        for name, waits in _WAITS.items():
            status = dataclasses.replace(busy_status, num_targets=targets, num_drafters=drafters, colocated=False,
                                         **waits)
            advice = balance_advice(status)
            split = _split_in(advice)
            if split is not None:
                assert sum(split) == targets + drafters and min(split) >= 1, (targets, drafters, advice)
            if name == "targets wait (q_hs full)":
                assert split == ((targets - 1, drafters + 1) if targets > 1 else None), advice
                assert ("add drafter ranks" in advice) == (targets == 1) and "lower --max-anchors" in advice
            if name == "drafters wait (q_hs empty)":
                assert split == ((targets + 1, drafters - 1) if drafters > 1 else None), advice
                assert ("add target ranks" in advice) == (drafters == 1) and "raise --max-anchors" in advice
            if name in ("both wait", "balanced", "targets wait on data"):
                assert split is None, advice
    # The demo's 2 targets + 1 drafter on CPU, targets waiting: it is told to move a target to the drafters.
    demo = dataclasses.replace(busy_status, num_targets=2, num_drafters=1, **_WAITS["targets wait (q_hs full)"])
    assert "--targets 1 --drafters 2" in balance_advice(demo)


# ------------------------------------------------------------------ a CPU line


def _cpu(status):
    from draftline.sizing.flops import PeakFlops

    return dataclasses.replace(status, gpus=[], tflops=0.0241, mfu=float("nan"),
                               peak=PeakFlops(66e9, "a CPU's matmul rate varies", 66e9, for_mfu=False))


def test_a_cpu_line_shows_no_gpu_columns_no_tflops_and_no_mfu(busy_status):
    status = _cpu(busy_status)
    line = status_line(status)
    assert "GPUs" not in line and "TFLOP/s" not in line and "MFU" not in line and "n/a n/a" not in line
    assert "24.1 GFLOP/s" in line
    text = _text(render_panel(status))
    assert "GPUs" not in text and "no GPU" not in text and "24.1 GFLOP/s" in text
    header = next(row for row in text.splitlines() if "samples/s" in row)
    assert "FLOP/s" in header and "MFU" not in header and "of ceiling" not in text
    assert "no MFU: a CPU's matmul rate varies" in text
    out = io.StringIO()
    Dashboard(Console(file=out, width=80), live=False).update(status)
    assert out.getvalue().startswith("no MFU: a CPU's matmul rate varies")
    # On GPU the same rate is in TFLOP/s, beside MFU.
    assert "312 TFLOP/s MFU 39.6%" in status_line(busy_status)


def test_cpu_ranks_sharing_cores_are_not_told_to_move_ranks(busy_status):
    """On CPU ranks share the host's cores: the advice is the colocated layout (one process per core), not a
    new split."""
    for targets, drafters in ((2, 1), (1, 2), (1, 1)):
        for name in ("targets wait (q_hs full)", "drafters wait (q_hs empty)"):
            status = dataclasses.replace(busy_status, num_targets=targets, num_drafters=drafters, colocated=False,
                                         cpu_cores=2, gpus=[], **_WAITS[name])
            advice = balance_advice(status)
            assert _split_in(advice) is None and "add " not in advice and "anchors" not in advice, advice
            assert "share this host's 2 CPU cores" in advice and advice.startswith(name.split(" (")[0]), advice
            assert "--colocated (--gpus 2" in advice, advice
    balanced = dataclasses.replace(busy_status, cpu_cores=2, **_WAITS["balanced"])
    assert balance_advice(balanced).startswith("balanced")
