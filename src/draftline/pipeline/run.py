"""One process of a training run: config, roles, build, run, and what happens on failure.

``run_training(config)`` is what every rank executes (alone for the colocated mode, under torchrun
otherwise). It reads top to bottom:

1. process group and store, roles (a pure function of the world size), health (heartbeats);
2. setup on rank 0 (run directory: fresh or resume; the dataset), published to the others;
3. build: the data plan, the target (target ranks), the drafter and optimizer (drafter ranks),
   the checkpoint to resume from, the preflight;
4. run the role's loop (colocated: the target in a thread, the drafter here);
5. finish: final checkpoint and export, final acceptance, or on failure a message that names the
   rank and cause, a checkpoint if the drafter state allows one, and a non-zero exit code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from draftline.checkpoint.export import save_drafter
from draftline.checkpoint.state import TrainerState, load_checkpoint, save_checkpoint
from draftline.config import TrainConfig, validate
from draftline.errors import DraftlineError
from draftline.model.target import TargetFeatures, load_embedding_and_head
from draftline.monitor.dashboard import Dashboard
from draftline.monitor.flops import DrafterShape, TargetShape, reference_drafter_flops, reference_target_flops, resolve_peak
from draftline.monitor.gpu import device_stats
from draftline.monitor.loggers import NullLogger, open_loggers
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.pipeline import rundir
from draftline.pipeline.build import (
    DistEnv, build_drafter, compute_dtype, drafter_config, pick_device, plan_data, resolve_data_dir,
)
from draftline.pipeline.drafter_worker import DrafterWorker, GradSync
from draftline.pipeline.health import Health, RunAborted, describe_exception, local_rank_info
from draftline.pipeline.monitor_loop import LineMonitor
from draftline.pipeline.optim import build_optimizer, build_scheduler
from draftline.pipeline.roles import Role, assign_roles, producer_of, split
from draftline.pipeline.target_worker import Prefetcher, TargetWorker, run_target_thread
from draftline.pipeline.transport import DistributedReceiver, DistributedSender, InProcessChannel, StoreClaims


def _job_store(restart: int):
    """A client of the job's store (torchrun's), under a prefix private to this start of the job."""
    store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(f"draftline/{restart}/", store)


class StopSignals:
    """SIGINT/SIGTERM ask for a clean stop at the next step boundary; a second one exits at once."""

    def __init__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        print(f"draftline: {signal.Signals(signum).name}: stopping at the next step boundary "
              "(checkpoint, then exit); send it again to exit at once", file=sys.stderr, flush=True)


class Line:
    """The state of this process's part of the run."""

    def __init__(self, config: TrainConfig, env: DistEnv, device: torch.device, role: Role, health: Health, store):
        self.config = config
        self.env = env
        self.device = device
        self.role = role
        self.health = health
        self.store = store
        self.signals = StopSignals()
        self.dtype = compute_dtype(config, device)
        self.run_dir = Path(config.out)
        self.worker: DrafterWorker | None = None
        self.monitor: LineMonitor | None = None
        self.logger = NullLogger()
        self.saved: Path | None = None
        self.drafter_group = None
        self.target_worker: TargetWorker | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        """Rank 0 decides fresh/resume and finds the data; every rank gets the same answer."""
        if self.env.rank == 0:
            try:
                decision = rundir.decide_start(self.config)
                rundir.prepare_run_dir(self.config, decision)
                data_dir = resolve_data_dir(self.config)
                checkpoint = decision.checkpoint
                start_step = int(checkpoint.name.split("-")[-1]) if checkpoint else 0
                setup = {"mode": decision.mode, "checkpoint": str(checkpoint) if checkpoint else None,
                         "start_step": start_step, "data_dir": str(data_dir)}
            except BaseException as exc:
                if self.store is not None:
                    self.store.set("setup_error", describe_exception(exc))
                raise
            if self.store is not None:
                self.store.set("setup", json.dumps(setup))
            return setup
        while not self.store.check(["setup"]):
            if self.store.check(["setup_error"]):
                raise RunAborted(f"rank 0 could not set the run up: {self.store.get('setup_error').decode()}")
            self.health.check()
            time.sleep(0.05)
        return json.loads(self.store.get("setup"))

    # ------------------------------------------------------------------ the run
    def run(self) -> str:
        setup = self.setup()
        self._write_rank_info()
        self.plan = plan = plan_data(self.config, Path(setup["data_dir"]), self.role.num_drafters)
        start_step = setup["start_step"]
        start_seq = start_step * plan.batches_per_step
        self.start_step = start_step
        if self.role.is_logging:
            self._print_plan(setup, plan)
        target = self._build_target() if self.role.is_target else None
        if self.role.is_drafter:
            self._build_drafter(target, setup)
        if self.role.is_logging:
            rundir.log_start(self.config, rundir.StartDecision(setup["mode"], setup["checkpoint"]), step=self.worker.step,
                             world_size=self.env.world_size, topology=self.topology())
            self.logger.log({"kind": "start", "time": time.time(), "elapsed_s": 0.0, "mode": setup["mode"],
                             "step": self.worker.step, "config": self.config.to_dict(), "topology": self.topology(),
                             "peak_flops": self.monitor.peak.flops, "peak_source": self.monitor.peak.source})

        if self.role.kind == "colocated":
            channel = InProcessChannel(self.config.topology.q_hs, self.health)
            target_worker = self._target_worker(target, channel, start_seq)
            thread = run_target_thread(target_worker, self.health)
            self.target_worker = target_worker
            self.worker.receiver = channel
            status = self._drafter_loop()
            thread.join(timeout=1.0)
            return status
        if self.role.is_target:
            capacity = max(1, -(-self.config.topology.q_hs // self.role.num_targets))
            sender = DistributedSender(StoreClaims(self.store), capacity, self.health)
            self.target_worker = self._target_worker(target, sender, start_seq)
            self.target_worker.run()
            self.health.report_done()
            return "finished"
        claims = StoreClaims(self.store, self._own_seqs(start_seq, self.role.num_drafters))
        self.worker.receiver = DistributedReceiver(
            claims, rank=self.env.rank,
            target_rank=lambda seq: self.role.target_rank(producer_of(seq, self.role.num_targets)),
            prefetch=2, batch_for=plan.batch, feature_width=self.feature_width, device=self.device,
            dtype=self.dtype, health=self.health,
        )
        return self._drafter_loop()

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
                "colocated": self.role.kind == "colocated", "world_size": self.env.world_size,
                "device": str(self.device.type)}

    def _print_plan(self, setup: dict, plan) -> None:
        c = self.config
        print(f"draftline: {setup['mode']} run in {self.run_dir}"
              + (f" from {setup['checkpoint']} (step {setup['start_step']})" if setup["checkpoint"] else ""))
        if self.role.kind != "colocated":
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

    # ------------------------------------------------------------------ builders
    def _build_target(self) -> TargetFeatures:
        layer_ids = drafter_config(self.config).dflash_config["target_layer_ids"]
        keep_all = self.role.kind == "colocated" and self.role.is_logging  # the same copy decodes for evaluation
        target = TargetFeatures(self.config.model.target, layer_ids, device=self.device, dtype=self.dtype,
                                keep_all_layers=keep_all, final_hidden=self.config.optim.distill > 0)
        self.health.watch(target.decoder.layers)
        if self.config.engine.preflight and self.device.type == "cuda":
            from draftline.pipeline.preflight import preflight_target

            self.target_preflight = preflight_target(self, target)
        return target

    def _target_worker(self, target: TargetFeatures, sender, start_seq: int) -> TargetWorker:
        plan = self.plan
        # Colocated, targets and drafters are the same ranks: the target thread computes exactly the
        # batches its own drafter trains.
        seqs = self._own_seqs(start_seq, self.role.num_targets)
        prefetcher = Prefetcher(seqs, plan.batch, self.config.topology.q_pre, self.health)
        shape = TargetShape.from_config(target.model.config)

        def publish(worker: TargetWorker) -> None:
            c = worker.counters
            stats = dict(self.health._stats)
            stats["target"] = {"batches": c.batches, "tokens": c.tokens, "flops": c.flops,
                               "wait_data_s": c.wait_data_s, "wait_drafters_s": c.wait_drafters_s,
                               "q_pre": prefetcher.depth(), "q_hs": sender.depth(),
                               "bytes_sent": getattr(sender, "bytes_sent", 0), "send_s": getattr(sender, "send_seconds", 0.0)}
            if self.role.kind != "colocated":
                stats["gpu"] = {**device_stats(self.device).to_record(), "rank": self.env.rank, "role": "target"}
            self.health.set_stats(stats)

        return TargetWorker(features=target, prefetcher=prefetcher, sender=sender, health=self.health,
                            shape=shape, layers_run=target.layers_run, on_batch=publish)

    def _build_drafter(self, target: TargetFeatures | None, setup: dict) -> None:
        c = self.config
        drafter = build_drafter(c, self.device)
        # With soft labels the target's final hidden state travels as the features' last columns.
        teacher = 1 if c.optim.distill > 0 else 0
        self.feature_width = (len(drafter.target_layer_ids) + teacher) * drafter.config.hidden_size
        if target is not None:
            embed, head = target.embed_weight(), target.head_weight()
        else:
            embed, head = load_embedding_and_head(c.model.target, device=self.device, dtype=self.dtype)
        settings = ObjectiveSettings(max_anchors=c.data.max_anchors, head_chunk_rows=c.engine.head_chunk_rows,
                                     attention=c.engine.attention, seed=c.data.seed, gamma=c.optim.loss_gamma,
                                     distill=c.optim.distill)
        objective = DFlashObjective(drafter, embed, head, settings)
        optimizer = build_optimizer(drafter, c.optim)
        scheduler = build_scheduler(optimizer, c.optim, self.plan.total_steps)
        group = None
        if self.role.num_drafters > 1:
            group = self.drafter_group
        if c.engine.preflight and self.device.type == "cuda":
            from draftline.pipeline.preflight import preflight_drafter

            preflight_drafter(self, objective, optimizer, target)
            optimizer = build_optimizer(drafter, c.optim)  # drop the state preflight allocated
            scheduler = build_scheduler(optimizer, c.optim, self.plan.total_steps)
        start_step = 0
        if setup["checkpoint"]:
            state = load_checkpoint(setup["checkpoint"], drafter=drafter, optimizer=optimizer, scheduler=scheduler)
            start_step = state.step
            per_step = self.plan.batches_per_step
            if state.step and state.next_seq != state.step * per_step:
                raise DraftlineError(
                    f"{setup['checkpoint']}: trained with {state.next_seq // state.step} batches per optimizer step, "
                    f"this run has {per_step} (--grad-accum per drafter x {self.role.num_drafters} drafter(s)): "
                    "resume with the checkpoint's --grad-accum and number of drafters so the data continues where it stopped"
                )
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
            activation_checkpointing=c.engine.activation_checkpointing,
            on_step=self._after_step, on_batch=self._trace_batch if c.engine.trace else None,
            stop_requested=self._stop_requested,
        )
        self.last_save_time = time.time()

    def _trace(self, name: str, record: dict) -> None:
        folder = self.run_dir / "trace"
        folder.mkdir(exist_ok=True)
        with (folder / name).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _trace_batch(self, worker: DrafterWorker, delivery) -> None:
        self._trace(f"drafter-{self.env.rank}.jsonl", {
            "step": delivery.seq // worker.batches_per_step, "seq": delivery.seq, "epoch": delivery.batch.epoch,
            "sample_ids": delivery.batch.sample_ids.tolist()})

    # ------------------------------------------------------------------ drafter side
    def _stop_requested(self) -> bool:
        if self.signals.requested:
            return True
        return self.store is not None and self.store.check(["stop_requested"])

    def _after_step(self, worker: DrafterWorker, vector: torch.Tensor) -> None:
        c = worker.counters
        stats = dict(self.health._stats)
        stats["drafter"] = {"step": c.step, "batches": c.batches, "wait_s": c.wait_s, "busy_s": c.busy_s}
        stats["gpu"] = {**device_stats(self.device).to_record(), "rank": self.env.rank, "role": self.role.kind}
        self.health.set_stats(stats)
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
        eval_every = self.config.monitor.eval_every
        if eval_every and worker.step % eval_every == 0 and worker.step < worker.total_steps:
            self.evaluate()

    # ------------------------------------------------------------------ evaluation
    def _eval_prompts(self) -> list[list[int]]:
        c = self.config.monitor
        if c.eval_prompts:
            from draftline.evaluate.prompts import read_prompts

            return read_prompts(c.eval_prompts, self.config.model.target, limit=c.eval_num_prompts)
        held = [r["input_ids"] for r in self.plan.dataset.heldout() if r.get("input_ids")]
        return held[: c.eval_num_prompts]

    def evaluate(self) -> dict | None:
        """Real acceptance (speculative decoding) on held-out prompts with the drafter as it is now."""
        from draftline.evaluate.acceptance import measure_acceptance

        if not hasattr(self, "_prompts"):
            self._prompts = self._eval_prompts()
        if not self._prompts:
            return None
        if getattr(self, "_eval_target", None) is None:
            if self.target_worker is not None:  # colocated: the same copy, all layers kept
                self._eval_target = self.target_worker.features.model
            else:  # a drafter rank: load a full copy once (bf16 on GPU)
                from transformers import AutoModelForCausalLM

                self._eval_target = AutoModelForCausalLM.from_pretrained(
                    self.config.model.target, dtype=self.dtype).to(self.device).eval().requires_grad_(False)
        drafter = self.worker.drafter
        start = time.time()
        was_training = drafter.training
        drafter.eval()
        pause = self.target_worker.paused() if self.target_worker is not None else nullcontext()
        try:
            with pause, torch.no_grad(), torch.autocast(self.device.type, dtype=self.dtype,
                                                        enabled=self.dtype != torch.float32):
                summary = measure_acceptance(self._eval_target, drafter, self._prompts,
                                             max_new_tokens=self.config.monitor.eval_max_new_tokens)
        finally:
            drafter.train(was_training)
        summary.update(kind="eval", time=time.time(), step=self.worker.step, seconds=time.time() - start)
        self.logger.log(summary)
        print(f"draftline: step {self.worker.step}: acceptance tau {summary['tau']:.2f} on {summary['num_prompts']} "
              f"held-out prompts ({summary['seconds']:.1f} s)", flush=True)
        return summary

    def save_checkpoint(self) -> Path:
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
                               state=state, keep=self.config.checkpoint.keep)
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
            self.save_checkpoint()
            if status == "finished":
                final = save_drafter(self.worker.drafter, self.run_dir / "final", dtype=torch.bfloat16)
                print(f"draftline: finished at step {self.worker.step}; drafter in {final}")
                self.evaluate()
            else:
                print(f"draftline: stopped at step {self.worker.step}; checkpoint {self.saved}; "
                      "continue with the same command and --resume")
            self.logger.log({"kind": "end", "time": time.time(), "elapsed_s": time.time() - self.monitor.started,
                             "step": self.worker.step, "status": status, "reason": "signal" if status == "stopped" else ""})
        if self.store is not None:
            self.store.set("run_over", status)
        self.health.report_done()
        return status

    # ------------------------------------------------------------------ failure
    def fail(self, exc: BaseException) -> int:
        """Name the failure, save what can be saved, return the exit code."""
        if isinstance(exc, DraftlineError):
            # Something the user can fix (config, data, memory): say it plainly; peers name this rank.
            self.health.report_failure(str(exc))
            where = f" ({self.health.info.describe()})" if self.env.world_size > 1 else ""
            print(f"draftline train: error{where}: {exc}", file=sys.stderr, flush=True)
            if self.role.is_logging and self.worker is not None:
                self.logger.log({"kind": "end", "time": time.time(), "elapsed_s": 0.0, "step": self.worker.step,
                                 "status": "failed", "reason": str(exc)})
            return 2
        if isinstance(exc, RunAborted):
            message = str(exc)
        else:
            cause = describe_exception(exc)
            # A communication error here is usually the echo of another rank's death: name that rank.
            culprit = self._find_culprit() if self.store is not None else None
            if culprit:
                message = f"{culprit} (seen by {self.health.info.describe()} as: {cause[:200]})"
                self.health.abort(message)
            else:
                self.health.report_failure(cause)
                message = self.health.aborted
        clean_stop = isinstance(exc, RunAborted) and self.store is not None and self.store.check(["run_over"])
        if clean_stop:
            return 0
        if self.role.is_logging or self.env.world_size == 1:
            print(f"\ndraftline: run failed: {message}", file=sys.stderr, flush=True)
        else:
            print(f"draftline: {self.health.info.describe()}: stopping: {message}", file=sys.stderr, flush=True)
        # The logging drafter saves; if it is the rank that died, the next drafter does.
        saver = self.role.is_logging or (self.role.is_drafter and self.role.index == 1 and self.health.failed_rank == 0)
        if saver and self.worker is not None and not self.worker.in_optimizer_step:
            try:
                path = self.save_checkpoint()
                print(f"draftline: checkpoint of the last completed step ({self.worker.step}) saved to {path}; "
                      "fix the cause and run the same command with --resume", file=sys.stderr, flush=True)
            except BaseException as save_exc:  # noqa: BLE001
                print(f"draftline: could not save a checkpoint: {describe_exception(save_exc)}", file=sys.stderr)
        if saver:
            try:
                (self.run_dir / "failure.json").write_text(json.dumps(
                    {"time": time.time(), "message": message, "step": self.worker.step if self.worker else None,
                     "checkpoint": str(self.saved) if self.saved else None}, indent=2) + "\n")
                self.logger.log({"kind": "end", "time": time.time(), "elapsed_s": 0.0,
                                 "step": self.worker.step if self.worker else None, "status": "failed", "reason": message})
            except OSError:
                pass
        return 1


    def _find_culprit(self, wait_s: float = 3.0) -> str | None:
        """Another rank's death or failure report, if one shows within ``wait_s``."""
        end = time.time() + wait_s
        while time.time() < end:
            try:
                found = self.health.scan()
            except Exception:  # noqa: BLE001 - the store itself is gone
                return None
            if found and found != "the drafters ended the run":
                return found
            time.sleep(0.2)
        return None


def run_training(config: TrainConfig) -> int:
    """Run this process's part of the training line; returns the exit code."""
    validate(config)
    env = DistEnv.from_environ()
    device = pick_device(config, env.local_rank)
    store = None
    if env.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
        store = _job_store(rundir.restart_count())
    colocated = config.topology.colocated
    num_targets, num_drafters = split(env.world_size, config.topology.targets, config.topology.drafters,
                                      None if colocated else _target_share(config), colocated=colocated)
    role = assign_roles(env.world_size, num_targets, num_drafters, colocated=colocated)[env.rank]
    health = Health(local_rank_info(env.rank, role.kind, device), store, env.world_size,
                    timeout_s=config.topology.failure_timeout_s)
    health.shared_process = role.kind == "colocated"
    line = Line(config, env, device, role, health, store)
    if env.world_size > 1:
        # All ranks create the drafters' group (a collective call), before anything can fail.
        line.drafter_group = dist.new_group(role.drafter_ranks) if num_drafters > 1 else None
    health.start()
    code = 0
    try:
        line.run()
    except BaseException as exc:  # noqa: BLE001 - every failure ends here, named
        code = line.fail(exc)
    finally:
        health.stop()
        line.logger.close()
    if env.world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0:
            os._exit(code)  # peers may be dead: tearing down the process group could hang
        dist.destroy_process_group()
    return code


def _target_share(config: TrainConfig) -> float | None:
    """The target's share of the work per sample (FLOP model), to balance a default split."""
    if config.topology.targets is not None or config.topology.drafters is not None:
        return None
    try:
        from draftline.model.target import load_target_config

        drafter_cfg = drafter_config(config)
        target_shape = TargetShape.from_config(load_target_config(config.model.target))
        drafter_shape = DrafterShape.from_config(drafter_cfg)
        if config.optim.distill > 0:
            drafter_shape = dataclasses.replace(drafter_shape, teacher_layers=target_shape.num_layers)
        t = reference_target_flops(target_shape, drafter_shape.target_layers_run)
        d = reference_drafter_flops(drafter_shape, num_anchors=config.data.max_anchors)
        return t / (t + d)
    except Exception:  # noqa: BLE001 - fall back to an even split
        return None
