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
                     "tau 1.87 (eval @1200) tf-acc 3.21", "ETA 1h02m", "add targets",
                     "[0:target 61.2/139.8 GiB 97% 1,755/1,980 MHz, power cap]"):
        assert expected in lines[1], expected
    assert status_line(busy_status) == lines[1]


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
    assert advice.startswith("drafters wait 35% of the time")
    assert "add targets" in advice and "--token-budget" in advice


def test_advice_when_targets_wait(busy_status):
    status = dataclasses.replace(busy_status, target_wait=0.4, drafter_wait=0.01, q_hs=20)
    advice = balance_advice(status)
    assert advice.startswith("targets wait 40% of the time (q_hs full)") and "add drafters" in advice


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
