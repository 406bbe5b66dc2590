"""The status display: a live ``rich`` panel on a terminal, one plain line per interval in a log.

    ┌ draftline · step 1,234/10,000 · epoch 2/6 · ETA 3h12m ─────────────────────┐
    │ throughput   Ktok/s  samples/s  FLOP/s  MFU  (peak and source; CPU: no MFU) │
    │ queues       q_pre per target, q_hs, batches/s and waiting per side        │
    │              -> which side waits and what to change                        │
    │ training     loss, accuracy, tau (measured), tf-acc, lr, grad, skipped     │
    │ GPUs         rank, role, name, memory used/total, utilisation (not on CPU) │
    └────────────────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import math
import sys
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from draftline.monitor.status import LineStatus, format_duration
from draftline.sizing.peak import format_flops

# A side that waits less than this is busy enough; balance is never perfect.
WAIT_THRESHOLD = 0.10


def _known(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _num(value: float | None, spec: str = ".3g") -> str:
    return format(value, spec) if _known(value) else "n/a"


def _pct(value: float | None) -> str:
    return f"{value:.0%}" if _known(value) else "n/a"


def _steps(status: LineStatus) -> str:
    total = f"/{status.total_steps:,}" if status.total_steps is not None else ""
    return f"step {status.step:,}{total}"


def _epoch(status: LineStatus) -> str:
    total = f"/{status.num_epochs}" if status.num_epochs is not None else ""
    return f"epoch {status.epoch + 1}{total}"


def _queue(fill: int, capacity: int | None) -> str:
    return f"{fill}/{capacity}" if capacity is not None else str(fill)


def _q_pre(status: LineStatus) -> str:
    if not status.q_pre:
        return "n/a"
    return " ".join(_queue(fill, status.q_pre_capacity) for fill in status.q_pre)


def _acc_row(status: LineStatus) -> str:
    # Whole percents keep all 15 slots of a B=16 block on one short line.
    return " ".join(f"{a * 100:.0f}" if _known(a) else "--" for a in status.accuracy_by_position)


def balance_advice(status: LineStatus) -> str:
    """Which side of the line waits, how much, and what to change in this layout.

    Targets wait when q_hs is full (drafters are slower) or their prefetch queues are empty (data
    is slower); drafters wait when q_hs is empty (targets are slower). A split (T targets + D
    drafters) is rebalanced by moving a rank to the slower side (``--targets``/``--drafters``, which
    the advice spells out) or by changing the drafter's work per token (``--max-anchors``). A
    colocated layout (one process, or ``--colocated``) has no split: target and drafter take turns
    on one device, so one of them waiting is how it runs, not a sign of idle hardware. CPU ranks of one
    host share its cores: moving a rank to the other side adds no compute, while ``--colocated`` (each
    process a target and a replicated drafter) keeps every core at work (the demo's line measured 2+1,
    1+1, 1+2 and colocated layouts: bench/demo_layouts.py; colocated and replicated was 1.45x 2+1).
    """
    target, drafter = status.target_wait, status.drafter_wait
    if not _known(target) or not _known(drafter):
        return "no waiting figures yet"
    target_waits, drafter_waits = target > WAIT_THRESHOLD, drafter > WAIT_THRESHOLD
    if target_waits and drafter_waits:
        return (
            f"both sides wait (targets {target:.0%}, drafters {drafter:.0%} of the time): the hand-off "
            "between them is slow, not the balance of work; check the transport and host-side work"
        )
    if target_waits:
        data_starved = bool(status.q_pre) and max(status.q_pre) == 0
        hs_full = status.q_hs_capacity is None or status.q_hs >= status.q_hs_capacity
        if data_starved and not hs_full:
            return f"targets wait {target:.0%} of the time on data (q_pre empty): data loading is the bottleneck"
    if status.colocated:
        if not (target_waits or drafter_waits):
            return f"balanced: target and drafter share each device (waits: target {target:.0%}, drafter {drafter:.0%})"
        side, other, wait = ("target", "drafter", target) if target_waits else ("drafter", "target", drafter)
        return (f"colocated: the {side} waits {wait:.0%} of the time while its {other} computes on the same device "
                f"(expected: nothing to rebalance; `draftline plan` compares a target/drafter split)")
    if status.cpu_cores is not None and (target_waits or drafter_waits):
        side, wait = ("targets", target) if target_waits else ("drafters", drafter)
        return (f"{side} wait {wait:.0%} of the time; the ranks share this host's {status.cpu_cores} CPU cores, so "
                f"another split adds no compute: --colocated (--gpus {status.cpu_cores}, each process a target and "
                "a drafter) keeps every core at work")
    t, d, k = status.num_targets, status.num_drafters, status.target_parallel  # target ranks move by whole groups
    if drafter_waits:
        move = f"--targets {t + k} --drafters {d - k}" if t and d and d > k else "add target ranks"
        return f"drafters wait {drafter:.0%} of the time (q_hs empty): {move}, or raise --max-anchors"
    if target_waits:
        move = f"--targets {t - k} --drafters {d + k}" if t and d and t > k else "add drafter ranks"
        return f"targets wait {target:.0%} of the time (q_hs full): {move}, or lower --max-anchors"
    return f"balanced: targets wait {target:.0%}, drafters {drafter:.0%} of the time"


def _mfu(status: LineStatus) -> str:
    """MFU against the spec peak, and against the measured matmul ceiling when that is known."""
    ceiling = status.mfu_ceiling
    return _pct_1(status.mfu) + (f" ({_pct_1(ceiling)} of ceiling)" if ceiling == ceiling else "")


def _quotes_mfu(status: LineStatus) -> bool:
    return status.peak is not None and status.peak.for_mfu


def _flops_rate(status: LineStatus) -> str:
    """The counted model FLOP rate in a unit that reads (a CPU line does GFLOP/s, not "0 TFLOP/s")."""
    return f"{format_flops(status.tflops * 1e12)}/s" if _known(status.tflops) else "n/a FLOP/s"


def render_panel(status: LineStatus) -> Panel:
    """The status as one ``rich`` panel."""
    throughput = Table.grid(padding=(0, 2))
    heads = ["Ktok/s", "samples/s", "FLOP/s"] + (["MFU"] if _quotes_mfu(status) else []) + ["trained on"]
    for _ in heads:
        throughput.add_column(justify="right")
    throughput.add_row(*heads)
    throughput.add_row(_num(status.ktok_s, ".1f"), _num(status.samples_s, ".2f"), _flops_rate(status),
                       *([_mfu(status)] if _quotes_mfu(status) else []),
                       f"{status.samples:,} samples, {status.tokens / 1e6:,.1f}M tokens")
    peak = Text(status.peak.describe() if status.peak is not None else "peak n/a: MFU unknown", style="dim")
    if status.compiling_s >= 0.5:
        peak.append(f"\ncompiled {status.compiling_s:.0f} s since the last status (a new shape): the rates include it",
                    style="yellow")

    queues = Table.grid(padding=(0, 2))
    queues.add_column(style="bold")
    queues.add_column()
    queues.add_row("q_pre", _q_pre(status))
    queues.add_row("q_hs", _queue(status.q_hs, status.q_hs_capacity))
    queues.add_row("targets", f"{_num(status.target_batches_s, '.2f')} batches/s, wait {_pct(status.target_wait)}")
    queues.add_row("drafters", f"{_num(status.drafter_batches_s, '.2f')} batches/s, wait {_pct(status.drafter_wait)}")
    queues.add_row("balance", Text(balance_advice(status), style="yellow"))

    training = Table.grid(padding=(0, 2))
    training.add_column(style="bold")
    training.add_column()
    training.add_row(
        "loss",
        f"{_num(status.loss, '.4f')}   acc {_num(status.accuracy, '.3f')}   {_tau(status)}"
        f"   tf-acc {_num(status.tf_acceptance, '.2f')}   lr {_num(status.lr, '.2e')}   grad {_num(status.grad_norm, '.3f')}   skipped {status.skipped_steps}",
    )
    training.add_row("acc % by slot", _acc_row(status) or "n/a")

    sections = [
        Text("throughput", style="bold cyan"), throughput, peak,
        Text("queues", style="bold cyan"), queues,
        Text("training", style="bold cyan"), training,
    ]
    if status.gpus:  # a CPU line has no device figures: no section of n/a
        gpus = Table(box=None, padding=(0, 2), show_edge=False)
        for name in ("rank", "role", "device", "memory", "util", "SM clock"):
            gpus.add_column(name, style="bold" if name == "rank" else None)
        for gpu in status.gpus:
            gpus.add_row(_opt(gpu.rank), _opt(gpu.role), gpu.name, gpu.memory_text(), gpu.util_text(), gpu.clock_text())
        sections += [Text("GPUs", style="bold cyan"), gpus]

    title = f"draftline · {_steps(status)} · {_epoch(status)} · ETA {format_duration(status.eta_s)}"
    body = Group(*sections)
    return Panel(body, title=title, title_align="left")


def _tau(status: LineStatus) -> str:
    """Measured tau with the step it is from; ``tf-acc`` beside it is the teacher-forced figure."""
    if not _known(status.tau):
        return "tau n/a (no eval yet)"
    return f"tau {status.tau:.2f} (eval @{status.tau_step})" if status.tau_step is not None else f"tau {status.tau:.2f}"


def _pct_1(value: float | None) -> str:
    return f"{value:.1%}" if _known(value) else "n/a"


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def status_line(status: LineStatus) -> str:
    """The status as one plain line, for logs."""
    gpus = " ".join(
        f"[{_opt(g.rank)}:{_opt(g.role)} {g.memory_text()} {g.util_text()} {g.clock_text()}]" for g in status.gpus
    )
    mfu = f" MFU {_mfu(status)}" if _quotes_mfu(status) else ""
    return (
        f"{_steps(status)} {_epoch(status)} | {_num(status.ktok_s, '.1f')} Ktok/s "
        f"{_num(status.samples_s, '.2f')} samples/s {_flops_rate(status)}{mfu} | "
        f"q_pre {_q_pre(status)} q_hs {_queue(status.q_hs, status.q_hs_capacity)} | "
        f"targets {_num(status.target_batches_s, '.2f')} b/s wait {_pct(status.target_wait)} | "
        f"drafters {_num(status.drafter_batches_s, '.2f')} b/s wait {_pct(status.drafter_wait)} | "
        f"loss {_num(status.loss, '.4f')} acc {_num(status.accuracy, '.3f')} "
        f"{_tau(status)} tf-acc {_num(status.tf_acceptance, '.2f')} lr {_num(status.lr, '.2e')} "
        f"grad {_num(status.grad_norm, '.3f')} skipped {status.skipped_steps} | "
        f"acc% {_acc_row(status) or 'n/a'} | {f'GPUs {gpus} | ' if gpus else ''}{_compiling(status)}"
        f"ETA {format_duration(status.eta_s)} | {balance_advice(status)}"
    )


def _compiling(status: LineStatus) -> str:
    """'compiled N s | ' when the line compiled since the status before (its rates then include the compilation)."""
    return f"compiled {status.compiling_s:.0f} s | " if status.compiling_s >= 0.5 else ""


class Dashboard:
    """Shows successive statuses: a live panel on a terminal, else one line per ``update``.

    The peak behind MFU, with its source, is printed once in line mode (the panel always shows it).
    """

    def __init__(self, console: Console | None = None, *, live: bool | None = None, file: IO[str] | None = None):
        self.console = console or Console(file=file or sys.stdout)
        self.live = self.console.is_terminal if live is None else live
        self._live: Live | None = None
        self._peak_printed = False

    def update(self, status: LineStatus) -> None:
        if self.live:
            panel = render_panel(status)
            if self._live is None:
                self._live = Live(panel, console=self.console, auto_refresh=False, transient=False)
                self._live.start()
            self._live.update(panel, refresh=True)
            return
        if not self._peak_printed and status.peak is not None:
            self._print(f"MFU against {status.peak.describe()}" if status.peak.for_mfu else status.peak.describe())
            self._peak_printed = True
        self._print(status_line(status))

    def _print(self, line: str) -> None:
        # No markup, no wrapping: log lines must stay greppable whatever the console width.
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> "Dashboard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
