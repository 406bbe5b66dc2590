"""One process's part of a training run: set up, wire the role's workers, run them, finish.

``Line.run`` reads top to bottom: agree on the setup with rank 0 (``setup``), plan the data, build
the target and/or the drafter (``build``), open the transport (``transport.open_transport``), run the
role's loop (colocated: the target in a thread, the drafter here), and finish (final checkpoint,
export, acceptance). After every optimizer step the logging drafter updates the monitor, and on
their cadence saves a checkpoint and measures acceptance (``evaluation``). A failure ends in
``failure.fail``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.state import TrainerState, save_checkpoint
from draftline.config import TrainConfig
from draftline.evaluate.acceptance import eval_interval, evaluate_in_training
from draftline.model.target import TargetFeatures
from draftline.monitor.dashboard import Dashboard
from draftline.monitor.flops import TargetShape, resolve_peak
from draftline.monitor.gpu import device_stats
from draftline.monitor.loggers import NullLogger, open_loggers
from draftline.pipeline import rundir
from draftline.pipeline.build import (
    DistEnv, build_drafter, build_objective, build_target, compute_dtype, feature_width, plan_data, resume_training,
)
from draftline.pipeline.drafter_worker import DrafterWorker, GradSync
from draftline.pipeline.evaluation import InTrainingEvaluation
from draftline.pipeline.failure import fail
from draftline.pipeline.health import Health
from draftline.pipeline.monitor_loop import LineMonitor
from draftline.pipeline.optim import build_optimizer, build_scheduler
from draftline.pipeline.roles import COLOCATED, Role
from draftline.pipeline.setup import RunSetup, agree_on_setup
from draftline.pipeline.signals import StopSignals
from draftline.pipeline.target_worker import Prefetcher, TargetWorker, run_target_thread
from draftline.pipeline.transport import open_transport


class Line:
    """The state of this process's part of the run."""

    def __init__(self, config: TrainConfig, env: DistEnv, device: torch.device, role: Role, health: Health, store,
                 drafter_group=None):
        self.config = config
        self.env = env
        self.device = device
        self.role = role
        self.health = health
        self.store = store
        self.drafter_group = drafter_group  # the drafters' process group (None with one drafter)
        self.signals = StopSignals()
        self.dtype = compute_dtype(config, device)
        self.run_dir = Path(config.out)
        self.worker: DrafterWorker | None = None
        self.target_worker: TargetWorker | None = None
        self.monitor: LineMonitor | None = None
        self.evaluate: InTrainingEvaluation | None = None
        self.logger = NullLogger()
        self.saved: Path | None = None
        self.feature_width = 0

    # ------------------------------------------------------------------ the run
    def run(self) -> str:
        setup = agree_on_setup(self.config, self.env.rank, self.store, self.health)
        self._write_rank_info()
        self.plan = plan = plan_data(self.config, Path(setup.data_dir), self.role.num_drafters)
        start_seq = setup.start_step * plan.batches_per_step
        if self.role.is_logging:
            self._print_plan(setup, plan)

        target = self._build_target() if self.role.is_target else None
        if self.role.is_drafter:
            self._build_drafter(target, setup)
        if self.role.is_logging:
            self._log_start(setup)

        sender, receiver = open_transport(
            self.role, self.health, q_hs=self.config.topology.q_hs, store=self.store,
            drafter_seqs=self._own_seqs(start_seq, self.role.num_drafters), batch_for=plan.batch,
            feature_width=self.feature_width, device=self.device, dtype=self.dtype,
        )
        if self.role.is_target:
            self.target_worker = self._target_worker(target, sender, start_seq)
        if self.role.is_logging:
            self.evaluate = InTrainingEvaluation(self.config, plan, self.device, self.dtype, self.logger,
                                                 target_worker=self.target_worker)
        if self.role.kind == COLOCATED:
            thread = run_target_thread(self.target_worker, self.health)
            self.worker.receiver = receiver
            status = self._drafter_loop()
            thread.join(timeout=1.0)
            return status
        if self.role.is_target:
            self.target_worker.run()
            self.health.report_done()
            return "finished"
        self.worker.receiver = receiver
        return self._drafter_loop()

    def fail(self, exc: BaseException) -> int:
        """Name the failure, save what can be saved, return the exit code (``failure.fail``)."""
        return fail(self, exc)

    def _own_seqs(self, start_seq: int, count: int):
        """Batch numbers from ``start_seq`` this rank handles as one of ``count`` targets or drafters."""
        plan = self.plan
        return (b.seq for b in plan.schedule.batches(start_seq, self.role.index, count) if b.seq < plan.end_seq)

    def _write_rank_info(self) -> None:
        """RUN_DIR/ranks/rank-N.json: which process is which (role, host, GPU, pid), for operators."""
        folder = self.run_dir / "ranks"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            info = {**self.health.info.__dict__, "role_index": self.role.index}
            (folder / f"rank-{self.env.rank}.json").write_text(json.dumps(info) + "\n")
        except OSError:
            pass  # the run directory may live on another node only

    def topology(self) -> dict:
        return {"targets": self.role.num_targets, "drafters": self.role.num_drafters,
                "colocated": self.role.kind == COLOCATED, "world_size": self.env.world_size,
                "device": str(self.device.type)}

    def _print_plan(self, setup: RunSetup, plan) -> None:
        c = self.config
        print(f"draftline: {setup.mode} run in {self.run_dir}"
              + (f" from {setup.checkpoint} (step {setup.start_step})" if setup.checkpoint else ""))
        if self.role.kind != COLOCATED:
            layout = f"{self.role.num_targets} target(s) + {self.role.num_drafters} drafter(s)"
        elif self.env.world_size == 1:
            layout = "target and drafter colocated on one device"
        else:
            layout = f"{self.env.world_size} ranks, each a target and a drafter (colocated, data-parallel drafters)"
        print(f"  topology: {layout} ({self.device.type})")
        print(f"  data: {len(plan.dataset)} samples, {int(plan.dataset.lengths.sum())} tokens, "
              f"{plan.schedule.total_batches} batches of <= {c.data.token_budget} tokens over {c.data.epochs} epoch(s)")
        print(f"  optimizer step: {plan.batches_per_step} batch(es); {plan.total_steps} steps"
              f"{' (--max-steps)' if c.optim.max_steps else ''}; lr {c.optim.lr} cosine, "
              f"warmup {round(c.optim.warmup_ratio * plan.total_steps)} steps")
        print(f"  queues: q_pre {c.topology.q_pre} per target, q_hs {c.topology.q_hs}; "
              f"checkpoints every {c.checkpoint.every_steps} steps / {c.checkpoint.every_minutes} min, keep {c.checkpoint.keep}")

    def _log_start(self, setup: RunSetup) -> None:
        rundir.log_start(self.config, rundir.StartDecision(setup.mode, setup.checkpoint), step=self.worker.step,
                         world_size=self.env.world_size, topology=self.topology())
        self.logger.log({"kind": "start", "time": time.time(), "elapsed_s": 0.0, "mode": setup.mode,
                         "step": self.worker.step, "config": self.config.to_dict(), "topology": self.topology(),
                         "peak_flops": self.monitor.peak.flops, "peak_source": self.monitor.peak.source})

    # ------------------------------------------------------------------ builders
    def _build_target(self) -> TargetFeatures:
        target = build_target(self.config, self.role, self.device, self.dtype)
        self.health.watch(target.decoder.layers)
        if self.config.engine.preflight and self.device.type == "cuda":
            from draftline.pipeline.preflight import preflight_target

            self.target_preflight = preflight_target(self, target)
        return target

    def _target_worker(self, target: TargetFeatures, sender, start_seq: int) -> TargetWorker:
        # Colocated, targets and drafters are the same ranks: the target thread computes exactly the
        # batches its own drafter trains.
        seqs = self._own_seqs(start_seq, self.role.num_targets)
        prefetcher = Prefetcher(seqs, self.plan.batch, self.config.topology.q_pre, self.health)
        shape = TargetShape.from_config(target.model.config)

        def publish(worker: TargetWorker) -> None:
            c = worker.counters
            self.health.stats.update("target", {
                "batches": c.batches, "tokens": c.tokens, "flops": c.flops,
                "wait_data_s": c.wait_data_s, "wait_drafters_s": c.wait_drafters_s,
                "q_pre": prefetcher.depth(), "q_hs": sender.depth(),
                "bytes_sent": getattr(sender, "bytes_sent", 0), "send_s": getattr(sender, "send_seconds", 0.0)})
            if self.role.kind != COLOCATED:
                self.health.stats.update("gpu", {**device_stats(self.device).to_record(), "rank": self.env.rank,
                                                 "role": "target"})

        return TargetWorker(features=target, prefetcher=prefetcher, sender=sender, health=self.health,
                            shape=shape, layers_run=target.layers_run, on_batch=publish, device=self.device)

    def _build_drafter(self, target: TargetFeatures | None, setup: RunSetup) -> None:
        c = self.config
        drafter = build_drafter(c, self.device)
        self.feature_width = feature_width(c, drafter)
        objective = build_objective(c, drafter, self.device, self.dtype, target)
        optimizer = build_optimizer(drafter, c.optim)
        scheduler = build_scheduler(optimizer, c.optim, self.plan.total_steps)
        group = self.drafter_group if self.role.num_drafters > 1 else None
        if c.engine.preflight and self.device.type == "cuda":
            from draftline.pipeline.preflight import preflight_drafter

            preflight_drafter(self, objective, optimizer, target)
            optimizer = build_optimizer(drafter, c.optim)  # drop the state preflight allocated
            scheduler = build_scheduler(optimizer, c.optim, self.plan.total_steps)
        start_step = 0
        if setup.checkpoint:
            start_step = resume_training(setup.checkpoint, drafter=drafter, optimizer=optimizer, scheduler=scheduler,
                                         batches_per_step=self.plan.batches_per_step,
                                         num_drafters=self.role.num_drafters, balance_steps=c.data.balance_steps)
        elif group is not None:
            for p in drafter.parameters():  # every drafter starts from rank 0's weights
                dist.broadcast(p.data, src=0, group=group)
        if self.role.is_logging:
            self.logger = open_loggers(self.run_dir, tensorboard=c.monitor.tensorboard, wandb=c.monitor.wandb,
                                       wandb_project=c.monitor.wandb_project, is_logging_rank=True)
            peak = resolve_peak(self.device, self.dtype, c.monitor.peak_tflops * 1e12 if c.monitor.peak_tflops else None)
            self.monitor = LineMonitor(
                health=self.health, logger=self.logger, dashboard=Dashboard(), block_size=drafter.block_size,
                total_steps=self.plan.total_steps, start_step=start_step, batches_per_step=self.plan.batches_per_step,
                schedule=self.plan.schedule, peak=peak, num_devices=self.env.world_size,
                q_pre_capacity=c.topology.q_pre, q_hs_capacity=c.topology.q_hs, interval_s=c.monitor.interval_s,
            )
        self.worker = DrafterWorker(
            objective=objective, optimizer=optimizer, scheduler=scheduler, receiver=None,
            sync=GradSync([p for p in drafter.parameters() if p.requires_grad], group, self.health),
            health=self.health, device=self.device, compute_dtype=self.dtype,
            batches_per_step=self.plan.batches_per_step, start_step=start_step, total_steps=self.plan.total_steps,
            max_query_rows=c.engine.max_query_rows, grad_clip=c.optim.grad_clip, max_bad_steps=c.optim.max_bad_steps,
            activation_checkpointing=c.engine.activation_checkpointing, compile_layers=c.engine.compile,
            on_step=self._after_step, on_batch=self._trace_batch if c.engine.trace else None,
            stop_requested=self._stop_requested,
        )
        self.last_save_time = time.time()

    # ------------------------------------------------------------------ drafter side
    def _trace(self, name: str, record: dict) -> None:
        folder = self.run_dir / "trace"
        folder.mkdir(exist_ok=True)
        with (folder / name).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _trace_batch(self, worker: DrafterWorker, delivery) -> None:
        self._trace(f"drafter-{self.env.rank}.jsonl", {
            "step": delivery.seq // worker.batches_per_step, "seq": delivery.seq, "epoch": delivery.batch.epoch,
            "sample_ids": delivery.batch.sample_ids.tolist()})

    def _stop_requested(self) -> bool:
        if self.signals.requested:
            return True
        return self.store is not None and self.store.check(["stop_requested"])

    def _after_step(self, worker: DrafterWorker, vector: torch.Tensor) -> None:
        c = worker.counters
        self.health.stats.update("drafter", {"step": c.step, "batches": c.batches, "wait_s": c.wait_s,
                                             "busy_s": c.busy_s})
        self.health.stats.update("gpu", {**device_stats(self.device).to_record(), "rank": self.env.rank,
                                         "role": self.role.kind})
        if self.signals.requested and self.store is not None:
            self.store.set("stop_requested", "1")
        if not self.role.is_logging:
            return
        self.monitor.on_step(worker, vector)
        if self.config.engine.trace:
            v = vector.cpu()
            self._trace("steps.jsonl", {"step": worker.step, "loss": float(v[0] / v[1]) if v[1] > 0 else None,
                                        "weight": float(v[1]), "lr": worker.scheduler.get_last_lr()[0]})
        every, minutes = self.config.checkpoint.every_steps, self.config.checkpoint.every_minutes
        due = (every and worker.step % every == 0) or (minutes and time.time() - self.last_save_time > minutes * 60)
        if due and worker.step < worker.total_steps:
            self.save_checkpoint()
        eval_every = eval_interval(self.config.monitor.eval_every, worker.total_steps)
        if eval_every and worker.step % eval_every == 0 and worker.step < worker.total_steps:
            evaluate_in_training(self._measure_acceptance, self.config.monitor)

    def _measure_acceptance(self, final: bool = False) -> dict | None:
        """Real acceptance of the drafter as it is now (logging rank): the one place its result returns.
        ``final``: at the end of the run, on the prompts and length ``draftline eval`` uses."""
        summary = self.evaluate(self.worker.drafter, self.worker.step, final=final)
        if summary is not None and self.monitor is not None:
            self.monitor.measured = summary  # the monitor's tau is the latest measured acceptance
        return summary

    def save_checkpoint(self, wait: bool = False) -> Path:
        """Checkpoint the current step: copied to host memory now, written in the background (``wait``: on disk before returning)."""
        if self.monitor is None:  # a drafter standing in for a dead rank 0
            self.last_save_time = time.time()
        w = self.worker
        state = TrainerState(
            step=w.step, next_seq=w.step * w.batches_per_step,
            in_flight=list(getattr(w.receiver, "claimed", [])),
            counters={"tokens": self.monitor.total_tokens if self.monitor else 0,
                      "samples": self.monitor.total_samples if self.monitor else 0,
                      "skipped_steps": w.counters.skipped_steps},
            config=self.config.to_dict(),
        )
        path = save_checkpoint(self.run_dir, drafter=w.drafter, optimizer=w.optimizer, scheduler=w.scheduler,
                               state=state, keep=self.config.checkpoint.keep, wait=wait)
        self.last_save_time = time.time()
        self.saved = path
        return path

    def _drafter_loop(self) -> str:
        if self.monitor is not None:
            self.monitor.start()
        try:
            status = self.worker.run()
        finally:
            if self.monitor is not None:
                self.monitor.stop()
        if self.role.is_logging:
            self.save_checkpoint(wait=True)  # the final or SIGTERM checkpoint is on disk before we say so
            if status == "finished":
                final = save_drafter(self.worker.drafter, self.run_dir / "final", dtype=torch.bfloat16)
                print(f"draftline: finished at step {self.worker.step}; drafter in {final}")
                self._measure_acceptance(final=True)
            else:
                print(f"draftline: stopped at step {self.worker.step}; checkpoint {self.saved}; "
                      "continue with the same command and --resume")
            self.logger.log({"kind": "end", "time": time.time(), "elapsed_s": time.time() - self.monitor.started,
                             "step": self.worker.step, "status": status, "reason": "signal" if status == "stopped" else ""})
        if self.store is not None:
            self.store.set("run_over", status)
        self.health.report_done()
        return status
