"""The logging rank's view of the whole line, every few seconds.

Inputs: the all-reduced step vectors (exact global loss, tokens and FLOPs of the drafter side, from
``on_step``), and every other rank's published counters (through ``Health.peer_stats``: targets'
queue depths, waits, batches and FLOPs; drafters' waits; each rank's GPU memory and utilisation).
Output: one ``LineStatus`` per interval, shown by the dashboard and logged to metrics.jsonl and
TensorBoard.
"""

from __future__ import annotations

import threading
import time

import torch

from draftline import run_files
from draftline.compile_clock import compile_seconds
from draftline.distributed.health import Health
from draftline.monitor.dashboard import Dashboard
from draftline.monitor.gpu import GpuStats
from draftline.monitor.gpu import device_stats
from draftline.monitor.status import LineStatus, RateMeter, eta_seconds
from draftline.objective.metrics import NUM_BLOCKS, SUMMARY_KEYS, WEIGHT_SUM, metrics_size, summarize
from draftline.sizing.peak import PeakFlops, mfu


def publish_drafter(health: Health, worker) -> None:
    """This drafter's counters and device figures, for the monitor on the first drafter (through the heartbeat)."""
    c = worker.counters
    health.stats.update("drafter", {"step": worker.step, "batches": c.batches, "wait_s": c.wait_s, "busy_s": c.busy_s,
                                    "compile_s": compile_seconds()})
    health.stats.update("gpu", {**device_stats(worker.device).to_record(), "rank": health.info.rank,
                                "role": health.info.role})


def write_trace(folder, name: str, record: dict) -> None:
    """One line of RUN_DIR/trace/NAME (``engine.trace``: what each step and drafter did, for audits and tests),
    whole or not at all (a full disk is named)."""
    import json
    import os

    from draftline.files import append_line, open_for_append

    folder.mkdir(exist_ok=True)
    fd = open_for_append(folder / name)
    try:
        append_line(fd, json.dumps(record) + "\n", folder / name, "a trace record to",
                    "free space there or train without --trace")
    finally:
        os.close(fd)


class DrafterPublisher:
    """What a drafter other than the first does after a step: publish its counters (its monitor is the first's)."""

    def __init__(self, health: Health):
        self.health = health
        self.started = 0.0

    def on_step(self, record, worker) -> None:
        publish_drafter(self.health, worker)

    def on_measurement(self, summary: dict) -> None:
        pass

    def start(self, ends_at: float | None = None) -> None:
        pass

    def stop(self) -> None:
        pass


class LineMonitor:
    def __init__(
        self,
        *,
        health: Health,
        logger,
        dashboard: Dashboard | None,
        block_size: int,
        total_steps: int,
        start_step: int,
        batches_per_step: int,
        schedule,
        peak: PeakFlops,
        num_devices: int,
        q_pre_capacity: int,
        q_hs_capacity: int,
        interval_s: float,
        window_s: float = 30.0,
        progress,
        trace_dir=None,
        cpu_cores: int | None = None,
        target_parallel: int = 1,
        objective=None,
    ):
        """``progress``: the run's (``pipeline.progress.Progress``: the tokens, samples and skipped steps shown
        are its, counted from the run's first step); ``objective``: the one whose metrics vector the step records
        carry (its ``metrics_size`` and ``summarize``: a method's own entries, DSpark's loss terms, reach the
        records as they are); None: the DFlash objective's at ``block_size``."""
        self.health = health
        self.cpu_cores = cpu_cores  # CPU ranks: the host's cores they share (the advice says so)
        self.target_parallel = target_parallel  # target ranks per group: the advice moves whole groups
        self.trace_dir = trace_dir  # engine.trace: each step's loss in trace/steps.jsonl
        self.logger = logger
        self.dashboard = dashboard
        self.block_size = block_size
        self.total_steps = total_steps
        self.step = start_step
        self.batches_per_step = batches_per_step
        self.schedule = schedule
        self.peak = peak
        self.num_devices = num_devices
        self.q_pre_capacity = q_pre_capacity
        self.q_hs_capacity = q_hs_capacity
        self.interval_s = interval_s
        self.started = time.time()
        self._lock = threading.Lock()
        self._size = objective.metrics_size if objective is not None else metrics_size(block_size)
        self._summarize = (objective.summarize if objective is not None
                           else lambda vector: summarize(vector, block_size))
        self._interval_vector = torch.zeros(self._size, dtype=torch.float64)
        self.tokens = RateMeter(window_s)
        self.samples = RateMeter(window_s)
        self.drafter_batches = RateMeter(window_s)
        self.steps = RateMeter(window_s)
        self.drafter_flops = RateMeter(window_s)
        self.target_flops = RateMeter(window_s)
        self.target_batches = RateMeter(window_s)
        self.target_wait = RateMeter(window_s)
        self.drafter_wait = RateMeter(window_s)
        self._last_target = {"flops": 0.0, "batches": 0.0, "wait": 0.0}
        self._last_drafter_wait = 0.0
        self._last_compile = 0.0
        self.progress = progress
        self.lr = float("nan")
        self.grad_norm = float("nan")
        self.last_status: LineStatus | None = None
        self.measured: dict = {}  # the latest evaluation record (real acceptance): ``on_measurement``
        self.ends_at: float | None = None
        self.transfer: dict = {"sent_gb": 0.0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._colocated = False

    # ------------------------------------------------------------------ inputs
    def on_step(self, record, worker) -> None:
        """Called by the logging drafter with each optimizer step's record (summed over the drafters, on the host)."""
        publish_drafter(self.health, worker)
        with self._lock:
            self._interval_vector += record.metrics[: self._size]
            self.tokens.add(record.tokens)
            self.samples.add(record.samples)
            self.drafter_batches.add(record.batches)
            self.drafter_flops.add(record.flops)
            self.steps.add(1)
            self.step = record.step
            self.lr = record.lr
            self.grad_norm = record.grad_norm
        if self.trace_dir is not None:
            write_trace(self.trace_dir, run_files.TRACE_STEPS, {"step": record.step, "loss": record.loss,
                                                        "weight": float(record.metrics[WEIGHT_SUM]), "lr": record.lr})

    def on_measurement(self, summary: dict) -> None:
        """The latest acceptance measured (an ``eval`` record): the tau of the status from now on."""
        self.measured = summary

    # ------------------------------------------------------------------ output
    def _peers(self, peers: dict[int, dict]) -> tuple[list[dict], list[dict]]:
        """The targets' and the drafters' stats among ``peers`` (``Health.peer_stats``: read once a snapshot, since
        each reading asks the store for every rank's heartbeat)."""
        targets, drafters = [], []
        self._colocated = False
        for rank, stats in sorted(peers.items()):
            if not stats:
                continue
            if stats.get("target"):
                targets.append(stats["target"])
            if stats.get("drafter"):
                drafters.append(stats["drafter"])
            if stats.get("target") and stats.get("drafter"):
                self._colocated = True  # one process runs both: the layout has no split
            if stats.get("gpu"):
                stats["gpu"].setdefault("rank", rank)
        return targets, drafters

    @staticmethod
    def _compile_seconds(peers: dict[int, dict]) -> float:
        """Seconds compiling, summed over the ranks (a colocated rank publishes its process's figure twice: once)."""
        total = 0.0
        for stats in peers.values():
            roles = [(stats or {}).get(role) or {} for role in ("target", "drafter")]
            total += max(role.get("compile_s", 0.0) for role in roles)
        return total

    def _epochs(self, step: int) -> tuple[int, float]:
        """(the epoch being trained, 0-based; epochs trained so far, fractions included) after ``step``."""
        total = self.schedule.total_batches
        done = min(step * self.batches_per_step, total)
        if done >= total:
            return self.schedule.num_epochs - 1, float(self.schedule.num_epochs)
        epoch, index = self.schedule.locate(done)
        return epoch, epoch + index / self.schedule.batcher.num_batches(epoch)

    def snapshot(self) -> LineStatus:
        peers = self.health.peer_stats()
        targets, drafters = self._peers(peers)
        # Target side: cumulative counters published by each target, turned into rates here.
        total = _target_totals(targets)
        self.target_flops.add(total["flops"] - self._last_target["flops"])
        self.target_batches.add(total["batches"] - self._last_target["batches"])
        self.target_wait.add(total["wait"] - self._last_target["wait"])
        self._last_target = total
        drafter_wait = sum(d.get("wait_s", 0.0) for d in drafters)
        self.drafter_wait.add(drafter_wait - self._last_drafter_wait)
        self._last_drafter_wait = drafter_wait
        compile_s = self._compile_seconds(peers)
        compiling_s, self._last_compile = max(0.0, compile_s - self._last_compile), compile_s
        with self._lock:
            vector = self._interval_vector.clone()
            self._interval_vector.zero_()
            step = self.step
        summary = self._summarize(vector) if vector[NUM_BLOCKS] > 0 else {}
        flops_rate = self.drafter_flops.rate() + self.target_flops.rate()
        steps_rate = self.steps.rate()
        epoch, epochs_done = self._epochs(step)
        gpus = []
        for rank, stats in sorted(peers.items()):
            gpu = (stats or {}).get("gpu")
            if gpu and gpu.get("name") != "cpu":  # a CPU rank has no device figures to show
                gpus.append(GpuStats(**gpu))
        num_targets = max(1, len(targets))
        num_drafters = max(1, len(drafters))
        status = LineStatus(
            step=step,
            total_steps=self.total_steps,
            epoch=epoch,
            num_epochs=self.schedule.num_epochs,
            epochs_done=epochs_done,
            samples=self.progress.samples,
            tokens=self.progress.tokens,
            loss=summary.get("loss", float("nan")),
            accuracy=summary.get("accuracy", float("nan")),
            accuracy_by_position=summary.get("accuracy_by_position", []),
            tf_acceptance=summary.get("tf_acceptance", float("nan")),
            tau=self.measured.get("tau", float("nan")), tau_step=self.measured.get("step"),
            lr=self.lr,
            grad_norm=self.grad_norm,
            skipped_steps=self.progress.skipped_steps,
            ktok_s=self.tokens.rate() / 1e3,
            samples_s=self.samples.rate(),
            tflops=flops_rate / 1e12,
            mfu=mfu(flops_rate, 1.0, self.peak.flops, self.num_devices) if self.peak.for_mfu else float("nan"),
            q_pre=[int(t.get("q_pre", 0)) for t in targets],
            q_hs=int(sum(t.get("q_hs", 0) for t in targets)),
            # A wait is reported when it ends, so one long wait can land in a single window: cap at 1.
            target_wait=min(1.0, self.target_wait.rate() / num_targets),
            drafter_wait=min(1.0, self.drafter_wait.rate() / num_drafters),
            target_batches_s=self.target_batches.rate(),
            drafter_batches_s=self.drafter_batches.rate(),
            eta_s=eta_seconds(step, self.total_steps, steps_rate, ends_at=self.ends_at),
            compile_s=compile_s,
            compiling_s=compiling_s,
            gpus=gpus,
            num_targets=len(targets) or None,
            num_drafters=len(drafters) or None,
            colocated=self._colocated,
            cpu_cores=self.cpu_cores,
            target_parallel=self.target_parallel,
            elapsed_s=time.time() - self.started,
            q_pre_capacity=self.q_pre_capacity,
            q_hs_capacity=self.q_hs_capacity,
            peak=self.peak,
            extras={k: v for k, v in summary.items() if k not in SUMMARY_KEYS},
        )
        sent = sum(t.get("bytes_sent", 0) for t in targets)
        send_s = sum(t.get("send_s", 0.0) for t in targets)
        self.transfer = {"sent_gb": sent / 1e9, "send_s": send_s, "gb_s": sent / 1e9 / send_s if send_s > 0 else None}
        self.last_status = status
        return status

    def emit(self) -> LineStatus:
        status = self.snapshot()
        record = status.to_record()
        if self.transfer["sent_gb"]:
            record["transfer"] = self.transfer  # hidden states sent GPU to GPU so far, and the rate of the sends
        self.logger.log(record)
        if self.dashboard is not None:
            self.dashboard.update(status)
        return status

    def start(self, ends_at: float | None = None) -> None:
        """``ends_at``: when the time limit ends the training (--max-minutes), for the ETA."""
        self.ends_at = ends_at
        # What the targets computed before the drafters began (warm-up, filling the queues) is not
        # part of the first interval's rate.
        peers = self.health.peer_stats()
        targets, drafters = self._peers(peers)
        self._last_target = _target_totals(targets)
        self._last_drafter_wait = sum(d.get("wait_s", 0.0) for d in drafters)
        self._last_compile = self._compile_seconds(peers)  # preflight's compilations are not the first window's

        def loop():
            said = None
            while not self._stop.wait(self.interval_s):
                try:
                    self.emit()
                    said = None
                except Exception as exc:  # noqa: BLE001 - the monitor must never take the run down
                    if str(exc) != said:  # once, not every interval (a full disk: until there is room again)
                        print(f"draftline: monitor error: {exc}", flush=True)
                    said = str(exc)

        self._thread = threading.Thread(target=loop, name="draftline-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.emit()  # the last interval
        finally:
            if self.dashboard is not None:
                self.dashboard.close()


def _target_totals(targets: list[dict]) -> dict:
    return {
        "flops": sum(t.get("flops", 0.0) for t in targets),
        "batches": sum(t.get("batches", 0) for t in targets),
        "wait": sum(t.get("wait_drafters_s", 0.0) for t in targets),
    }
