"""``draftline report``: PNG plots and a one-page Markdown summary of a run directory.

Everything comes from RUN_DIR/metrics.jsonl (docs/ARCHITECTURE.md) and goes to RUN_DIR/report/.
A plot whose fields the log never has is skipped and listed in the summary, so a CPU run (no
GPU memory) or a run without evaluations still gets a report.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from draftline import run_files
from draftline.evaluate.run_log import RunLog, read_run_log
from draftline.files import write_atomic


@dataclass
class Report:
    directory: Path
    summary: Path
    plots: list[Path] = field(default_factory=list)
    skipped_plots: dict[str, str] = field(default_factory=dict)
    """Plot name -> why it was not drawn."""


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, safe in threads and on servers
    import matplotlib.pyplot as plt

    return plt


def _panels(plt, count: int, title: str):
    fig, axes = plt.subplots(count, 1, figsize=(8, 2.6 * count + 0.6), sharex=True, squeeze=False)
    fig.suptitle(title)
    return fig, [row[0] for row in axes]


def _line(ax, log: RunLog, key: str, label: str | None = None, kind: str = "train", **style) -> bool:
    xs, ys = log.series(kind, key)
    if xs:
        ax.plot(xs, ys, label=label or key, **style)
    return bool(xs)


def _save(fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel(axes[-1].get_xlabel() or "step")
    fig.tight_layout()
    _write_png(fig, path)
    _pyplot().close(fig)
    return path


def _write_png(fig, path: Path) -> None:
    """The figure rendered in memory, then written whole or not at all (``files.write_atomic``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    write_atomic(path, buffer.getvalue(), "the plot", _FIX)


_FIX = "free space there and run `draftline report` again"


def _list_series(log: RunLog, key: str, kind: str = "train") -> tuple[list[float], list[list[float]]]:
    """Steps and the list-valued field ``key`` at each (entries may be None)."""
    steps, rows = [], []
    for record in log.of_kind(kind):
        value = record.get(key)
        if isinstance(value, list) and value and isinstance(record.get("step"), (int, float)):
            steps.append(record["step"])
            rows.append([v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in value])
    return steps, rows


def plot_loss(plt, log: RunLog, path: Path) -> Path | None:
    fig, axes = _panels(plt, 3, "loss, accuracy, gradient norm")
    drawn = _line(axes[0], log, "loss")
    axes[0].set_ylabel("loss")
    _line(axes[1], log, "accuracy", "accuracy (drafted slots)")
    axes[1].set_ylabel("accuracy")
    _line(axes[2], log, "grad_norm", "grad norm (before clipping)")
    axes[2].set_ylabel("grad norm")
    return _save(fig, axes, path) if drawn else _close(plt, fig)


def plot_accuracy_by_position(plt, log: RunLog, path: Path) -> Path | None:
    steps, rows = _list_series(log, "accuracy_by_position")
    if not rows:
        return _close(plt, None)
    fig, (last_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4))
    fig.suptitle("accuracy by block slot")
    last = rows[-1]
    slots = list(range(1, len(last) + 1))
    last_ax.bar(slots, [v or 0.0 for v in last], color="tab:blue")
    last_ax.set(xlabel="slot k", ylabel="accuracy", title=f"last (step {int(steps[-1])})", ylim=(0, 1), xticks=slots)
    cmap = plt.get_cmap("viridis")
    for k in range(len(last)):
        pts = [(s, r[k]) for s, r in zip(steps, rows) if k < len(r) and r[k] is not None]
        if pts:
            time_ax.plot(*zip(*pts), color=cmap(k / max(len(last) - 1, 1)), label=f"slot {k + 1}")
    time_ax.set(xlabel="step", ylabel="accuracy", title="over time", ylim=(0, 1))
    if len(last) <= 16:
        time_ax.legend(fontsize="x-small", ncol=2)
    for ax in (last_ax, time_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _write_png(fig, path)
    plt.close(fig)
    return path


def _first(*values):
    return next((v for v in values if v is not None), None)


def plot_acceptance(plt, log: RunLog, path: Path) -> Path | None:
    fig, axes = _panels(plt, 1, "acceptance length: measured by decoding (tau) vs teacher-forced on training blocks")
    drawn = _line(axes[0], log, "tau", "tau: measured, speculative decoding of held-out prompts", kind="eval", marker="o")
    # Runs logged before the teacher-forced figure had its name called it expected_acceptance.
    tf_key = "tf_acceptance" if any("tf_acceptance" in r for r in log.of_kind("train")) else "expected_acceptance"
    drawn |= _line(axes[0], log, tf_key, "teacher-forced, uniform anchors (overstates tau)")
    axes[0].set_ylabel("tokens per target step")
    return _save(fig, axes, path) if drawn else _close(plt, fig)


def plot_throughput(plt, log: RunLog, path: Path) -> Path | None:
    fig, axes = _panels(plt, 3, "throughput")
    drawn = _line(axes[0], log, "ktok_s", "Ktok/s")
    drawn |= _line(axes[1], log, "samples_s", "samples/s")
    drawn |= _line(axes[1], log, "tflops", "TFLOP/s")
    xs, ys = log.series("train", "mfu")
    if xs:
        axes[2].plot(xs, [100 * y for y in ys], label="MFU %")
        drawn = True
    axes[2].set_ylabel("MFU %")
    return _save(fig, axes, path) if drawn else _close(plt, fig)


def plot_queues(plt, log: RunLog, path: Path) -> Path | None:
    fig, axes = _panels(plt, 2, "queues and waiting")
    steps, rows = _list_series(log, "q_pre")
    drawn = False
    for t in range(max((len(r) for r in rows), default=0)):
        pts = [(s, r[t]) for s, r in zip(steps, rows) if t < len(r) and r[t] is not None]
        if pts:
            axes[0].plot(*zip(*pts), label=f"q_pre target {t}", alpha=0.8)
            drawn = True
    drawn |= _line(axes[0], log, "q_hs", "q_hs (hidden states)", color="black", linewidth=2)
    axes[0].set_ylabel("batches waiting")
    drawn |= _line(axes[1], log, "target_wait", "targets waiting")
    drawn |= _line(axes[1], log, "drafter_wait", "drafters waiting")
    axes[1].set_ylabel("fraction of wall time")
    return _save(fig, axes, path) if drawn else _close(plt, fig)


def plot_memory(plt, log: RunLog, path: Path) -> Path | None:
    t0 = next((r["time"] for r in log.records if isinstance(r.get("time"), (int, float))), None)
    per_gpu: dict[str, dict[str, list]] = {}
    for record in log.of_kind("train"):
        if not isinstance(record.get("time"), (int, float)) or t0 is None:
            continue
        hours = (record["time"] - t0) / 3600
        for gpu in record.get("gpus") or []:
            if not isinstance(gpu, dict) or not isinstance(gpu.get("mem_used_gib"), (int, float)):
                continue
            name = f"rank {gpu.get('rank', '?')} {gpu.get('role') or ''}".strip()
            # the card (--gpu-memory-gib) where one was set, else the device's total
            total = gpu.get("mem_budget_gib") if isinstance(gpu.get("mem_budget_gib"), (int, float)) else gpu.get(
                "mem_total_gib")
            series = per_gpu.setdefault(name, {"h": [], "used": [], "allocated": [], "total": total, "util": []})
            series["h"].append(hours)
            series["used"].append(gpu["mem_used_gib"])
            allocated = gpu.get("mem_allocated_gib")
            series["allocated"].append(allocated if isinstance(allocated, (int, float)) else float("nan"))
            series["util"].append(gpu.get("util") if isinstance(gpu.get("util"), (int, float)) else float("nan"))
    if not per_gpu:
        return _close(plt, None)
    fig, axes = _panels(plt, 2, "GPU memory and utilisation")
    for name, s in per_gpu.items():
        (line,) = axes[0].plot(s["h"], s["used"], label=name)
        axes[0].plot(s["h"], s["allocated"], color=line.get_color(), linestyle="--", linewidth=0.9)
        if isinstance(s["total"], (int, float)):
            axes[0].axhline(s["total"], color=line.get_color(), linestyle=":", linewidth=0.8)
        axes[1].plot(s["h"], [100 * u for u in s["util"]], color=line.get_color())
    axes[0].set_ylabel("GiB: device in use (dashed: allocator's peak; dotted: the card or the device)")
    axes[1].set_ylabel("utilisation %")
    axes[1].set_xlabel("hours since the first start")
    return _save(fig, axes, path)


def plot_method_loss(plt, log: RunLog, path: Path) -> Path | None:
    """A method's own loss terms (DSpark: cross-entropy, L1 to the target's distribution, the confidence BCE)."""
    fig, axes = _panels(plt, 2, "DSpark's loss terms (weighted means per label)")
    drawn = _line(axes[0], log, "ce", "CE of the Markov-corrected logits")
    drawn |= _line(axes[0], log, "l1", "L1 to the target's distribution (2 TV)")
    axes[0].set_ylabel("per label")
    drawn |= _line(axes[1], log, "confidence_bce", "confidence BCE")
    drawn |= _line(axes[1], log, "confidence_abs_error", "|confidence - expected acceptance|")
    axes[1].set_ylabel("per label")
    return _save(fig, axes, path) if drawn else _close(plt, fig)


def plot_confidence_calibration(plt, log: RunLog, path: Path) -> Path | None:
    """The confidence head's calibration per slot: on the training blocks (its prediction against the slot's
    expected acceptance 1 - TV, what it is trained on) and in decoding (against the acceptance realised by the
    steps that reached the slot), the latest of each."""
    steps, predicted = _list_series(log, "confidence_by_position")
    _, expected = _list_series(log, "expected_acceptance_by_position")
    decoded = next((r["confidence_calibration"] for r in reversed(log.of_kind("eval"))
                    if isinstance(r.get("confidence_calibration"), dict)), None)
    if not predicted and decoded is None:
        return _close(plt, None)
    panels = [p for p in (predicted and "train", decoded and "decode") if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    fig.suptitle("the confidence head: predicted vs realised acceptance per slot")
    for ax, panel in zip(axes[0], panels):
        if panel == "train":
            pairs = [("predicted (confidence head)", predicted[-1]), ("expected acceptance 1 - TV (its target)",
                                                                     expected[-1] if expected else [])]
            ax.set_title(f"training blocks, step {int(steps[-1])}")
        else:
            pairs = [("predicted", decoded.get("predicted") or []), ("realised", decoded.get("realised") or [])]
            ax.set_title("decoding (steps that reached the slot), last eval")
        for label, values in pairs:
            pts = [(k, v) for k, v in enumerate(values, start=1) if isinstance(v, (int, float)) and math.isfinite(v)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xlabel="slot k (1 = the anchor's slot)", ylabel="acceptance", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    _write_png(fig, path)
    plt.close(fig)
    return path


def _close(plt, fig) -> None:
    if fig is not None:
        plt.close(fig)
    return None


PLOTS = {
    "loss": (plot_loss, "no loss in any train record"),
    "accuracy_by_position": (plot_accuracy_by_position, "no accuracy_by_position in any train record"),
    "acceptance": (plot_acceptance, "neither tau (eval) nor tf_acceptance (train) records"),
    "throughput": (plot_throughput, "no ktok_s, samples_s, tflops or mfu"),
    "queues": (plot_queues, "no q_pre, q_hs or wait fractions"),
    "memory": (plot_memory, "no GPU memory in any train record (a CPU run?)"),
    # A method's own plots (DSpark's): drawn where its records have the figures, not listed as missing elsewhere.
    "method_loss": (plot_method_loss, None),
    "confidence_calibration": (plot_confidence_calibration, None),
}


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _percent(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "n/a"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _config_lines(config: dict) -> list[str]:
    lines = []
    for section, values in config.items():
        if isinstance(values, dict):
            items = ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items() if v not in (None, [], {}, ""))
            lines.append(f"- **{section}**: {items or '(defaults)'}")
        elif values not in (None, "", [], {}):
            lines.append(f"- **{section}**: {json.dumps(values)}")
    return lines


def _epochs_row(log: RunLog, start: dict) -> str:
    """Epochs trained: the record's count (2.00 of 2 for a 2-epoch run that is through). A record of an
    older writer has only the 0-based epoch being trained, shown as such, 1-based."""
    config = start.get("config") if isinstance(start.get("config"), dict) else {}
    of = log.last("train", "num_epochs") or (config.get("data") or {}).get("epochs")
    total = f" of {of}" if of else ""
    done = log.last("train", "epochs_done")
    if isinstance(done, (int, float)):
        return f"| epochs trained | {done:.2f}{total} |"
    epoch = log.last("train", "epoch")
    if isinstance(epoch, int):
        return f"| epoch being trained | {epoch + 1}{total} |"
    return "| epochs trained | n/a |"


def summary_markdown(run_dir: Path, log: RunLog, report: Report) -> str:
    segments = log.segments
    first_start = next((s.start for s in segments if s.start), {})
    last_start = next((s.start for s in reversed(segments) if s.start), {})
    # Only an end record of the last start says how the run ended; an earlier one was resumed past.
    end = next((r for r in reversed(segments[-1].records) if r.get("kind") == "end"), None) if segments else None
    wall_s = sum(s.wall_s for s in segments)
    gpu_hours = sum(s.wall_s * s.num_gpus for s in segments) / 3600
    any_gpu = any(s.num_gpus for s in segments)
    step = log.last("train", "step")
    total_steps = log.last("train", "total_steps")
    evals = log.of_kind("eval")

    status = end.get("status", "?") if end else "no end record (running, or killed)"
    if end and end.get("reason"):
        status += f" ({end['reason']})"
    modes = [s.start.get("mode", "?") for s in segments if s.start]
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"Status: **{status}**, step {_fmt(step)} of {_fmt(total_steps)}; "
        f"{len(modes)} start(s): {', '.join(modes) or 'none recorded'}.",
        "",
        "| | |",
        "|---|---|",
        f"| samples | {_fmt(log.last('train', 'samples'))} |",
        f"| tokens | {_fmt(log.last('train', 'tokens'))} |",
        f"| optimizer steps | {_fmt(step)} |",
        _epochs_row(log, first_start),
        f"| final loss | {_fmt(log.last('train', 'loss'))} |",
        f"| final accuracy | {_fmt(log.last('train', 'accuracy'))} |",
        "| tau (measured: speculative decoding, held-out prompts) | "
        + (f"{_fmt(evals[-1].get('tau'))} (step {_fmt(evals[-1].get('step'))}, {_fmt(evals[-1].get('num_prompts'))} prompts) |"
           if evals else "n/a (no eval records) |"),
        "| teacher-forced acceptance (uniform anchors; overstates tau) | "
        f"{_fmt(_first(log.last('train', 'tf_acceptance'), log.last('train', 'expected_acceptance')))} |",
        f"| throughput (last) | {_fmt(log.last('train', 'ktok_s'))} Ktok/s"
        + (f", MFU {_percent(log.last('train', 'mfu'))} |" if log.last("train", "mfu") is not None else " (no MFU: CPU) |"),
        f"| wall time | {_duration(wall_s)} |",
        f"| GPU-hours | {f'{gpu_hours:.2f}' if any_gpu else 'n/a (CPU run)'} |",
        "",
        "## Topology",
        "",
    ]
    topology = last_start.get("topology") if isinstance(last_start.get("topology"), dict) else {}
    lines += [f"- {k}: {_fmt(v)}" for k, v in topology.items()] or ["- not recorded"]
    config = first_start.get("config") if isinstance(first_start.get("config"), dict) else {}
    lines += ["", "## Config", ""] + (_config_lines(config) or ["- not recorded"])
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in report.plots]
    lines += [f"- {name}: not drawn, {why}" for name, why in report.skipped_plots.items()]
    calibration = _calibration_lines(log)
    if calibration:
        lines += [""] + calibration
    if log.skipped_lines:
        lines += ["", f"Note: skipped unreadable metrics.jsonl line(s) {log.skipped_lines[:10]}"
                      f"{' ...' if len(log.skipped_lines) > 10 else ''} (a truncated last line is normal after a kill)."]
    return "\n".join(lines) + "\n"


def _calibration_lines(log: RunLog) -> list[str]:
    """The confidence head's calibration as a table (a DSpark run with one): per slot, the prediction against the
    expected acceptance on the training blocks and against the acceptance realised in decoding."""
    predicted, expected = log.last("train", "confidence_by_position"), log.last("train", "expected_acceptance_by_position")
    decoded = next((r["confidence_calibration"] for r in reversed(log.of_kind("eval"))
                    if isinstance(r.get("confidence_calibration"), dict)), None)
    if not isinstance(predicted, list) and decoded is None:
        return []
    rows = max(len(predicted or []), len((decoded or {}).get("predicted") or []))

    def cell(values, k):
        return _fmt(values[k], 3) if isinstance(values, list) and k < len(values) else "n/a"

    lines = ["## Confidence head", "",
             "Predicted acceptance per slot against what it is trained on (the slot's expected acceptance 1 - TV on "
             "the last training window) and against what decoding realised (the last eval: the steps that reached "
             "the slot).", "",
             "| slot | predicted (train) | expected (train) | predicted (decode) | realised (decode) | steps |",
             "|---|---|---|---|---|---|"]
    d = decoded or {}
    for k in range(rows):
        lines.append(f"| {k + 1} | {cell(predicted, k)} | {cell(expected, k)} | {cell(d.get('predicted'), k)} | "
                     f"{cell(d.get('realised'), k)} | {cell(d.get('steps'), k)} |")
    return lines + [""]


def write_report(run_dir: str | Path) -> Report:
    """Read RUN_DIR/metrics.jsonl, write RUN_DIR/report/*.png and summary.md."""
    run_dir = Path(run_dir)
    log = read_run_log(run_dir)
    out = run_dir / run_files.REPORT
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, out / "summary.md")
    plt = _pyplot()
    for name, (plot, why) in PLOTS.items():
        path = plot(plt, log, out / f"{name}.png")
        if path is None and why is not None:
            report.skipped_plots[name] = why
        elif path is not None:
            report.plots.append(path)
    plt.close("all")
    write_atomic(report.summary, summary_markdown(run_dir, log, report).encode("utf-8"), "the summary", _FIX)
    return report
