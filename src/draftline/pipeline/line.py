"""One process's part of a training run: build its role's pieces from the spec, run its loop, finish.

``Line.run`` reads top to bottom: print the plan (first drafter), build the target (``build``) and
check its worst case (``preflight``), build the drafter worker, check its worst case and resume it
(``checkpoint.manager.resume``), open the transport (``transport.open_transport``) and the checkpoint
manager (``checkpoint.manager.CheckpointManager``, handed the run's stateful objects), run the role's loop
(colocated: the target in a thread, the drafter here, ``loop.train``), and finish (final checkpoint,
export, the final measurement). A failure ends in ``failure.fail`` with ``Line.failure_context``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from draftline import compile_clock, run_files
from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.manager import CheckpointManager, CheckpointPolicy, resume
from draftline.checkpoint.writer import check_disk_space
from draftline.cores import usable_cores
from draftline.distributed import keys, rundir
from draftline.distributed.failure import FailureContext
from draftline.distributed.health import Health
from draftline.distributed.shard import DrafterGroup, local_tensor
from draftline.distributed.signals import StopSignals
from draftline.distributed.target_group import TargetGroup
from draftline.evaluate.during_training import InTrainingEvaluation
from draftline.model.target import TargetFeatures
from draftline.monitor.dashboard import Dashboard
from draftline.monitor.gpu import device_stats
from draftline.monitor.live import DrafterPublisher, LineMonitor, write_trace
from draftline.monitor.loggers import NullLogger, open_loggers
from draftline.pipeline import loop
from draftline.pipeline.build import (
    SPLIT_TARGET_EVALUATION, build_drafter_worker, build_evaluation, build_target, build_target_worker,
)
from draftline.pipeline.drafter_worker import DrafterWorker
from draftline.pipeline.spec import RunSpec
from draftline.pipeline.target_worker import TargetWorker, run_target_thread
from draftline.pipeline.transport import open_transport
from draftline.sizing.peak import resolve_peak


class Line:
    """This process's part of the run (see the module docstring)."""

    def __init__(self, spec: RunSpec, health: Health, store, group: DrafterGroup, signals: StopSignals,
                 resume_note: str | None = None, target_group: TargetGroup | None = None):
        """``group``: the drafters' groups; ``target_group``: this rank's target group (None: a whole target per
        rank, or no target here)."""
        self.spec = spec
        self.health = health
        self.store = store
        self.group = group
        self.target_group = target_group
        self.signals = signals
        self.resume_note = resume_note
        self.logger = NullLogger()
        self.target_worker: TargetWorker | None = None
        self.worker: DrafterWorker | None = None
        self.checkpointer: CheckpointManager | None = None
        self.monitor = DrafterPublisher(health)
        self.evaluation: InTrainingEvaluation | None = None
        self.receiver = None
        self.target_preflight = None  # the target's preflight result (a colocated drafter's adds its transient)
        self.target_thread = None  # colocated: the target's thread
        self.time_limit: loop.TimeLimit | None = None
        """--max-minutes (set as the training starts), or None."""

    # ------------------------------------------------------------------ the run
    def run(self) -> str:
        spec, role = self.spec, self.spec.role
        compile_clock.install()  # before the first compilation: the monitor shows the time steps spend compiling
        self._write_rank_info()
        if role.is_logging:
            self._print_plan()
        # ---- build
        target = self._build_target() if role.is_target else None
        if role.is_drafter:
            self._build_drafter(target)
        # ---- transport
        sender, self.receiver = open_transport(
            role, self.health, q_hs=spec.q_hs, store=self.store,
            drafter_seqs=(s for step in range(spec.start_step, spec.total_steps) for s in spec.drafter_seqs(step)),
            batch_for=spec.data.batch, feature_width=spec.model.feature_width, device=spec.device, dtype=spec.dtype,
            batches_per_step=spec.batches_per_step,
        )
        if role.is_target:
            self.target_worker = build_target_worker(spec, target, sender, self.health, on_batch=self._after_target_batch,
                                                     group=self.target_group)
        if role.is_drafter:
            c = spec.config.checkpoint
            self.checkpointer = CheckpointManager(
                spec.run_dir, drafter=self.worker.drafter, optimizer=self.worker.optimizer,
                states=self.checkpoint_states(), keep=c.keep, config=spec.config.to_dict(), group=self.group,
                policy=CheckpointPolicy(c.every_steps, c.every_minutes, spec.total_steps))
            self.evaluation = build_evaluation(spec, self.group, self.logger,
                                               target_worker=self.target_worker if spec.colocated else None)
        # ---- run
        if spec.colocated:
            self.target_thread = run_target_thread(self.target_worker, self.health)
            status = self._train()
            self.target_thread.join(timeout=1.0)
            return status
        if role.is_target:
            self.target_worker.run()
            self.health.report_done()
            return loop.FINISHED
        return self._train()

    def _train(self) -> str:
        minutes, worker = self.spec.config.optim.max_minutes, self.worker
        if minutes is not None:
            self.time_limit = loop.TimeLimit(minutes, start_progress=worker.scheduler.progress(worker.step))
        self.monitor.start(ends_at=None if self.time_limit is None else self.time_limit.ends_at)
        try:
            status = loop.train(self.spec, worker, self.receiver, monitor=self.monitor,
                                checkpointer=self.checkpointer, evaluation=self.evaluation,
                                stop_requested=self._stop_requested, time_limit=self.time_limit)
        finally:
            self.monitor.stop()  # its last record: the rates of the training's last interval
        self.finish_drafter(status)
        self.end_drafter(status)
        return status

    def finish_drafter(self, status: str) -> None:
        """The end of a drafter's run: its checkpoint (on disk before we say so), on a finish the exported
        drafter and the final measurement; every drafter takes part."""
        spec, worker, first = self.spec, self.worker, self.group.is_first
        saved = self.checkpointer.save(wait=True)
        if status == loop.FINISHED:
            weights = self.group.full_weights(worker.drafter)
            if first:
                final = save_drafter(worker.drafter, spec.run_dir / run_files.FINAL, dtype=torch.bfloat16, weights=weights)
                early = (f" of {spec.total_steps} (--max-minutes {spec.config.optim.max_minutes:g} reached)"
                         if worker.step < spec.total_steps else "")
                print(f"draftline: finished at step {worker.step}{early}; drafter in {final}")
            summary = self.evaluation.final(worker.drafter, worker.step)
            if summary is not None:
                self.monitor.on_measurement(summary)
        elif first:
            print(f"draftline: stopped at step {worker.step}; checkpoint {saved}; "
                  "continue with the same command and --resume")

    def end_drafter(self, status: str) -> None:
        """The end record (the first drafter), and the run over for every rank."""
        worker, first = self.worker, self.group.is_first
        if first:
            self.logger.log({"kind": "end", "time": time.time(), "elapsed_s": time.time() - self.monitor.started,
                             "step": worker.step, "status": status,
                             "reason": "signal" if status == loop.STOPPED
                             else "time limit" if worker.step < self.spec.total_steps else ""})
            if self.store is not None:
                self.store.set(keys.RUN_OVER, status)
        self.health.report_done()

    def join_threads(self, timeout_s: float = 30.0) -> None:
        """After a failure (health aborted): wait for the colocated target thread to leave its pass, so that no
        thread is inside a torch call when the interpreter shuts down (which aborts the process)."""
        if self.target_thread is not None:
            self.target_thread.join(timeout=timeout_s)

    def failure_context(self) -> FailureContext:
        """What ``failure.fail`` may use on this rank."""
        worker, role = self.worker, self.spec.role

        def save_last_step():
            worker.read_record(check=False)  # the last step's record (read one step late) and its update, queued
            if worker.in_optimizer_step:
                raise RuntimeError("the failure came inside the optimizer step: the weights are half-updated")
            return self.checkpointer.save()

        saves = worker is not None and self.checkpointer is not None and role.is_logging and not self.group.several
        return FailureContext(self.health, role, self.spec.env.world_size, self.store, self.spec.run_dir,
                              self.logger, step=lambda: worker.step if worker is not None else None,
                              save=save_last_step if saves else None, writes_report=role.is_logging,
                              stands_in=role.is_drafter and role.index == 1)

    # ------------------------------------------------------------------ builders
    def _build_target(self) -> TargetFeatures:
        if self.target_group is not None:
            # Its forward's all-reduces poll nothing: after a failure elsewhere (a peer of the group that died inside
            # one), this rank ends itself if its main thread does not reach the failure handler.
            self.health.exit_if_stuck(15.0)
        target = build_target(self.spec, self.target_group)
        self.health.watch(target.decoder.layers)
        if self.spec.config.engine.preflight and self.spec.device.type == "cuda":
            from draftline.sizing.preflight import preflight_target

            self.target_preflight = preflight_target(self.spec, target, self.health.info.describe(),
                                                     group=self.target_group)
        return target

    def _build_drafter(self, target: TargetFeatures | None) -> None:
        spec, c = self.spec, self.spec.config
        if self.group.several:
            self.health.exit_if_stuck(15.0)
        self.worker = worker = build_drafter_worker(spec, self.health, group=self.group, target=target,
                                                    on_batch=self._trace_batch if c.engine.trace else None)
        if c.engine.preflight and spec.device.type == "cuda":
            from draftline.sizing.preflight import preflight_drafter

            preflight_drafter(spec, worker, self.health.info.describe(), self.target_preflight)
        if spec.checkpoint:
            resume(spec.checkpoint, drafter=worker.drafter, optimizer=worker.optimizer, states=self.checkpoint_states(),
                   group=self.group, step=spec.start_step, next_seq=spec.start_seq)
        if spec.role.is_logging:
            self._open_monitor()

    def checkpoint_states(self) -> dict:
        """The run's objects a checkpoint holds (``checkpoint.manager``): the progress, the schedule and, once the
        transport is open, its batches in flight."""
        states = {"progress": self.worker.progress, "scheduler": self.worker.scheduler}
        if self.receiver is not None:
            states["transport"] = self.receiver
        return states

    def _open_monitor(self) -> None:
        spec, c = self.spec, self.spec.config
        problem = check_disk_space(spec.run_dir, spec.model.num_trained_params, c.checkpoint.keep)
        if problem:
            print(f"draftline: warning: {problem}: checkpoints will fail; free space, lower --keep or move --out",
                  flush=True)
        self.logger = open_loggers(spec.run_dir, tensorboard=c.monitor.tensorboard, wandb=c.monitor.wandb,
                                   wandb_project=c.monitor.wandb_project, is_logging_rank=True)
        peak = resolve_peak(spec.device, spec.dtype, c.monitor.peak_tflops * 1e12 if c.monitor.peak_tflops else None)
        self.monitor = LineMonitor(
            health=self.health, logger=self.logger, dashboard=Dashboard(), block_size=spec.model.block_size,
            total_steps=spec.total_steps, start_step=spec.start_step, batches_per_step=spec.batches_per_step,
            schedule=spec.data.schedule, peak=peak, num_devices=spec.env.world_size,
            # Colocated, every rank has a hidden-state queue of its own; the status sums the queues' batches.
            q_pre_capacity=c.topology.q_pre, interval_s=c.monitor.interval_s,
            q_hs_capacity=spec.q_hs * (spec.role.num_targets if spec.colocated else 1),
            progress=self.worker.progress, trace_dir=spec.run_dir / run_files.TRACE if c.engine.trace else None,
            cpu_cores=usable_cores() if spec.device.type == "cpu" else None,
            target_parallel=spec.role.target_parallel, objective=self.worker.objective,
        )
        rundir.log_start(c, rundir.StartDecision(spec.mode, Path(spec.checkpoint) if spec.checkpoint else None),
                         step=spec.start_step, world_size=spec.env.world_size, topology=self.topology())
        self.logger.log({"kind": "start", "time": time.time(), "elapsed_s": 0.0, "mode": spec.mode,
                         "step": spec.start_step, "config": c.to_dict(), "topology": self.topology(),
                         "init": spec.model.init, "peak_flops": peak.flops, "peak_source": peak.source})

    # ------------------------------------------------------------------ along the way
    def _after_target_batch(self, worker: TargetWorker) -> None:
        c = worker.counters
        sender = worker.sender
        record = {
            "batches": c.batches, "tokens": c.tokens, "flops": c.flops,
            "wait_data_s": c.wait_data_s, "wait_drafters_s": c.wait_drafters_s,
            "q_pre": worker.prefetcher.depth(), "q_hs": sender.depth(),
            "bytes_sent": getattr(sender, "bytes_sent", 0), "send_s": getattr(sender, "send_seconds", 0.0),
            "compile_s": compile_clock.compile_seconds()}
        k = self.spec.role.target_parallel
        if k > 1:
            # Every rank of a target group computes each of the group's batches, doing 1/K of its work: each counts
            # its share, so the monitor's sums over the target ranks count each batch and its FLOPs once.
            record.update(batches=c.batches / k, tokens=c.tokens / k, flops=c.flops / k)
        self.health.stats.update("target", record)
        if not self.spec.colocated:
            self.health.stats.update("gpu", {**device_stats(self.spec.device).to_record(), "rank": self.spec.env.rank,
                                             "role": "target"})
            if self.signals.requested and self.store is not None:  # a target's signal stops the drafters
                self.store.set(keys.STOP_REQUESTED, "1")

    def _trace_batch(self, worker: DrafterWorker, delivery) -> None:
        write_trace(self.spec.run_dir / run_files.TRACE, run_files.drafter_trace(self.spec.env.rank), {
            "step": delivery.seq // self.spec.batches_per_step, "seq": delivery.seq, "epoch": delivery.batch.epoch,
            "sample_ids": delivery.batch.sample_ids.tolist(),
            # The sum of this rank's weights (its shard, when sharded) as the batch began: replicated drafters'
            # agree at every step.
            "weights": float(sum(local_tensor(p).detach().double().sum() for p in worker.params))})

    def _stop_requested(self) -> bool:
        if self.signals.requested:
            return True
        return self.store is not None and self.store.check([keys.STOP_REQUESTED])

    # ------------------------------------------------------------------ for operators
    def _write_rank_info(self) -> None:
        """RUN_DIR/ranks/rank-N.json: which process is which (role, host, GPU, pid), for operators."""
        folder = self.spec.run_dir / run_files.RANKS
        try:
            folder.mkdir(parents=True, exist_ok=True)
            info = {**self.health.info.__dict__, "role_index": self.spec.role.index}
            (folder / run_files.rank_file(self.spec.env.rank)).write_text(json.dumps(info) + "\n")
        except OSError:
            pass  # the run directory may live on another node only

    def topology(self) -> dict:
        role = self.spec.role
        return {"targets": role.num_targets, "drafters": role.num_drafters, "colocated": self.spec.colocated,
                "target_parallel": role.target_parallel,
                "world_size": self.spec.env.world_size, "device": str(self.spec.device.type),
                "sharded": self.group.sharded, "replicated": self.group.replicated}

    def _print_plan(self) -> None:
        spec, c, plan = self.spec, self.spec.config, self.spec.data
        role = spec.role
        print(f"draftline: {spec.mode} run in {spec.run_dir}"
              + (f" from {spec.checkpoint} (step {spec.start_step})" if spec.checkpoint else ""))
        if self.resume_note:
            print(f"  resume: {self.resume_note}")
        k = role.target_parallel
        if not spec.colocated:
            targets = (f"{role.num_targets} target(s)" if k == 1 else
                       f"{role.num_target_groups} target(s) of {k} ranks each (tensor-parallel; ranks "
                       f"{', '.join('-'.join(map(str, (g[0], g[-1]))) for g in role.all_target_groups())})")
            layout = f"{targets} + {role.num_drafters} drafter(s)"
        elif spec.env.world_size == 1:
            layout = "target and drafter colocated on one device"
        elif k == 1:
            layout = f"{spec.env.world_size} ranks, each a target and a drafter (colocated)"
        else:
            layout = (f"{spec.env.world_size} ranks, each a drafter beside one rank of a target group of {k} "
                      f"(colocated: {role.num_target_groups} target(s), tensor-parallel)")
        sharding = "" if role.num_drafters == 1 else (
            f"; the drafter replicated on the {role.num_drafters} drafters (gradients all-reduced)"
            if self.group.replicated else f"; the drafter's state sharded over the {role.num_drafters} drafters (FSDP2)")
        print(f"  topology: {layout} ({spec.device.type}){sharding}")
        m = spec.model
        print(f"  method: {m.method.describe(m.drafter_config)}"
              + ("; the target also sends its final hidden state" if m.final_hidden else "")
              + ("; the target's linear layers in FP8 (--target-fp8)" if c.model.target_fp8 else ""))
        print(f"  drafter: {m.drafter_config.num_hidden_layers} layers, block {m.block_size}, "
              f"{m.num_trained_params / 1e6:,.1f}M trained parameters, features of target layers {list(m.layer_ids)}; "
              f"starts {m.describe_init()}")
        print(f"  data: {len(plan.dataset)} samples, {int(plan.dataset.lengths.sum())} tokens, "
              f"{plan.schedule.total_batches} batches of <= {c.data.token_budget} tokens over {c.data.epochs} epoch(s)")
        print(f"  optimizer step: {spec.batches_per_step} batch(es); {spec.total_steps} steps"
              f"{' (--max-steps)' if c.optim.max_steps else ''}; lr {c.optim.lr} cosine, "
              f"warmup {round(c.optim.warmup_ratio * spec.total_steps)} steps")
        if k > 1:
            print(f"  acceptance: {SPLIT_TARGET_EVALUATION}")
        print(f"  queues: q_pre {c.topology.q_pre} per target, q_hs {spec.q_hs}; "
              f"checkpoints every {c.checkpoint.every_steps} steps / {c.checkpoint.every_minutes} min, keep {c.checkpoint.keep}")
