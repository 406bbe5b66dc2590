"""``draftline report`` renders plots and a summary from a synthetic metrics.jsonl.

The log has what real ones have: a fresh start and a resume, records missing newer fields, nulls
where a value was not finite, evaluations, an end record, and a last line cut mid-write.
"""

from __future__ import annotations

import json

from draftline.cli import main
from draftline.evaluate.report import write_report
from draftline.evaluate.run_log import read_run_log

T0 = 1_700_000_000.0
CONFIG = {"model": {"target": "/models/tiny", "draft_layers": 5, "block_size": 8},
          "optim": {"lr": 6e-4, "max_steps": None}, "out": "/runs/x"}
TOPOLOGY = {"targets": 1, "drafters": 1, "colocated": False, "world_size": 2, "device": "cuda"}


def train_record(step, t, **extra):
    record = {"kind": "train", "time": T0 + t, "elapsed_s": t, "step": step, "total_steps": 40, "epoch": 0,
              "samples": 10 * step, "tokens": 2800 * step, "loss": 5.0 / step, "accuracy": 0.05 * step ** 0.5,
              "accuracy_by_position": [0.6 - 0.07 * k + 0.005 * step for k in range(7)],
              "tf_acceptance": 1 + 0.1 * step, "lr": 6e-4, "grad_norm": None, "ktok_s": 20.0 + step,
              "samples_s": 7.0, "tflops": 300.0, "mfu": 0.4, "q_pre": [3, 5], "q_hs": step % 4,
              "target_wait": 0.1, "drafter_wait": 0.02,
              "gpus": [{"rank": 0, "role": "target", "name": "H200", "mem_used_gib": 60 + step, "mem_total_gib": 140, "util": 0.9,
                        "mem_allocated_gib": 55.0 + step, "mem_budget_gib": 94.97},
                       {"rank": 1, "role": "drafter", "name": "H200", "mem_used_gib": 80.0, "mem_total_gib": 140, "util": 0.8}]}
    record.update(extra)
    return record


def synthetic_log(run_dir):
    records = [{"kind": "start", "time": T0, "elapsed_s": 0.0, "mode": "fresh", "step": 0, "config": CONFIG,
                "topology": TOPOLOGY}]
    records += [train_record(s, 50.0 * s) for s in range(1, 21)]
    records += [{"kind": "eval", "time": T0 + 500, "elapsed_s": 500, "step": 10, "tau": 2.1,
                 "acceptance_hist": [5, 3, 2, 1, 0, 0, 0, 1], "acceptance_by_position": [0.6, 0.3], "num_prompts": 8}]
    records += [{"kind": "end", "time": T0 + 1000, "elapsed_s": 1000, "step": 20, "status": "stopped", "reason": "signal"}]
    t1 = T0 + 5000  # resumed later: the gap between the runs is not wall time of the run
    records += [{"kind": "start", "time": t1, "elapsed_s": 0.0, "mode": "resume", "step": 20, "config": CONFIG,
                 "topology": TOPOLOGY}]
    records += [{"kind": "train", "time": t1 + 40 * (s - 20), "elapsed_s": 40 * (s - 20), "step": s, "loss": 5.0 / s,
                 "samples": 10 * s, "tokens": 2800 * s} for s in range(21, 41)]  # an older writer: few fields
    records += [{"kind": "eval", "time": t1 + 800, "elapsed_s": 800, "step": 40, "tau": 3.4,
                 "acceptance_hist": [1] * 8, "acceptance_by_position": [0.7] * 7, "num_prompts": 8}]
    lines = [json.dumps(r) for r in records] + ['{"kind": "train", "time": 17000058']
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))


def test_report_from_a_resumed_gpu_run(tmp_path, capsys):
    synthetic_log(tmp_path)
    log = read_run_log(tmp_path)
    assert log.skipped_lines == [46] and len(log.segments) == 2

    assert main(["report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    names = ["loss", "accuracy_by_position", "acceptance", "throughput", "queues", "memory"]
    for name in names:
        png = tmp_path / "report" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
        assert str(png) in printed
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert str(tmp_path / "report" / "summary.md") in printed
    assert "| samples | 400 |" in summary and "| tokens | 112,000 |" in summary
    assert "| optimizer steps | 40 |" in summary
    assert "| tau (measured: speculative decoding, held-out prompts) | 3.4 (step 40, 8 prompts) |" in summary
    assert "| teacher-forced acceptance (uniform anchors; overstates tau) | 3 |" in summary
    assert "| wall time | 0:30:00 |" in summary  # 1000 s + 800 s, not the gap between them
    assert "| GPU-hours | 1.00 |" in summary  # 1800 s x 2 GPUs
    assert "fresh, resume" in summary and "world_size: 2" in summary and "block_size=8" in summary
    assert "![loss](loss.png)" in summary and "truncated last line" in summary


def test_report_of_a_sparse_cpu_log(tmp_path):
    records = [{"kind": "start", "time": T0, "mode": "fresh", "topology": {"device": "cpu", "world_size": 1}},
               {"kind": "train", "time": T0 + 10, "step": 1, "loss": 3.0},
               {"kind": "train", "time": T0 + 20, "step": 2, "loss": None}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report = write_report(tmp_path)
    assert [p.name for p in report.plots] == ["loss.png"]
    assert set(report.skipped_plots) == {"accuracy_by_position", "acceptance", "throughput", "queues", "memory"}
    summary = report.summary.read_text()
    assert "n/a (CPU run)" in summary and "no end record" in summary and "memory: not drawn" in summary


def test_report_without_a_log_says_what_is_missing(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_run_that_finished_two_epochs_reports_two(qwen3_target, line_data, tmp_path):
    """Through the line: the monitor counts epochs trained, the summary shows them (not the 0-based
    index of the last epoch, which read "epoch 1")."""
    from line_helpers import base_args

    out = tmp_path / "run"
    assert main(["train", *base_args(qwen3_target, line_data, out, epochs=2)]) == 0
    assert main(["report", str(out)]) == 0
    summary = (out / "report" / "summary.md").read_text()
    assert "| epochs trained | 2.00 of 2 |" in summary
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"kind": "train"' in line][-1]
    assert last["epochs_done"] == 2.0 and last["num_epochs"] == 2 and last["epoch"] == 1
    assert last["gpus"] == [] and last["mfu"] is None  # a CPU run: no device rows, no MFU
    assert last["layout"] == {"targets": 1, "drafters": 1, "colocated": True}


def test_an_older_writers_epoch_is_shown_as_the_epoch_being_trained(tmp_path):
    synthetic_log(tmp_path)
    write_report(tmp_path)
    assert "| epoch being trained | 1 |" in (tmp_path / "report" / "summary.md").read_text()
