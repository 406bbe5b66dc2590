"""The drafter role's step: its share of a step's batches in, passes through the objective, one update out.

Step ``k`` is the batches numbered ``k*G .. (k+1)*G - 1`` (G = batches per step), dealt round robin to
the drafters (``roles.drafter_share``). A drafter trains its share (``accumulate``: each batch in one
or more passes of at most ``max_query_rows`` block rows, which the objective plans and builds; each
pass is one forward, all blocks in one attention pass, and one backward); then ``queue_update`` sums
the metrics (replicated drafters: the gradients too) over the drafters, divides the gradients by the
step's total label weight, clips and steps AdamW. So the result of a step does not depend on how its
batches were spread over drafters or split into passes. Sharded (several drafters), every drafter runs
as many passes as the busiest one: ``shard.DrafterGroup``.

The host runs one step ahead of the GPU. ``queue_update`` queues step ``k``'s update and returns
without waiting; the step's record (metrics, gradient norm, stop and save flags), copied to the
host before its update runs, is read by ``read_record`` once step ``k + 1``'s passes are queued. So the
host prepares and launches the next step while the GPU still works on this one. What the record
decides comes one step late and is exact: a non-finite step is left out by the update itself (a
device flag), and the loop (``pipeline.loop``) stops before taking step ``k + 1`` when the drafters
agreed at step ``k`` to stop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from draftline.distributed.health import Health
from draftline.distributed.memory import OutOfMemoryContext, gib, out_of_memory_context
from draftline.distributed.shard import DrafterGroup
from draftline.errors import DraftlineError
from draftline.objective.loss import DFlashObjective
from draftline.objective.metrics import LOSS_SUM, WEIGHT_SUM
from draftline.pipeline.optim import clip_factor, grad_norm, grad_sq_norm, step_with_factor
from draftline.pipeline.progress import Progress
from draftline.pipeline.transport import Delivery
from draftline.sizing.flops import drafter_flops_of_blocks
from draftline.sizing.shapes import DrafterShape

# Entries appended to the metrics vector for the step's all-reduce.
TOKENS, SAMPLES, BATCHES, FLOPS, STOP, SAVE, GRAD_SQ, TIME_UP, CLOCK = range(9)
_NUM_EXTRA = 9


@dataclass
class DrafterCounters:
    """What this drafter did (host-side numbers for the monitor; the run's progress is ``progress.Progress``)."""

    batches: int = 0
    tokens: int = 0
    samples: int = 0
    passes: int = 0
    empty_passes: int = 0
    flops: float = 0.0
    busy_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    bad_in_a_row: int = 0
    last_grad_norm: float = float("nan")


@dataclass(frozen=True)
class StepRecord:
    """What an optimizer step did, summed over the drafters, on the host (read one step late)."""

    step: int
    """The steps completed with this one (1 for the first)."""
    metrics: torch.Tensor
    """The metrics vector (``objective.metrics``) summed over the step's passes and drafters."""
    tokens: int
    samples: int
    batches: int
    flops: float
    """The drafter side's model FLOPs of the step (all drafters)."""
    grad_norm: float
    lr: float
    stop: bool
    """A drafter was asked to stop (a signal): every drafter stops after this step."""
    save: bool
    """The first drafter's checkpoint clock is due: every drafter saves after this step."""
    time_up: bool = False
    """A drafter's time limit (--max-minutes) has passed: every drafter finishes after this step."""
    clock: float = 0.0
    """The share of the time limit spent, the drafters' mean (0: no time limit): the schedule follows it."""

    @property
    def finite(self) -> bool:
        return math.isfinite(float(self.metrics[LOSS_SUM])) and math.isfinite(self.grad_norm)

    @property
    def loss(self) -> float | None:
        weight = float(self.metrics[WEIGHT_SUM])
        return float(self.metrics[LOSS_SUM]) / weight if weight > 0 else None


class DrafterWorker:
    """Trains the drafter on the batches it is handed; see the module docstring."""

    def __init__(
        self,
        *,
        objective: DFlashObjective,
        optimizer: torch.optim.Optimizer,
        scheduler,
        group: DrafterGroup,
        health: Health,
        device: torch.device,
        compute_dtype: torch.dtype,
        progress: Progress,
        total_steps: int,
        max_query_rows: int,
        grad_clip: float,
        max_bad_steps: int,
        shape: DrafterShape,
        activation_checkpointing: bool = False,
        on_batch=None,
    ):
        """``shape``: the drafter's, as the run resolved it (``ModelSpec.drafter_shape``), for its FLOP count;
        ``progress``: the run's (this worker advances it: a step queued, a step's record read)."""
        self.objective = objective
        self.drafter = objective.drafter
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.group = group
        self.health = health
        self.device = device
        self.compute_dtype = compute_dtype
        self.progress = progress
        self.total_steps = total_steps
        self.block_size = objective.block_size
        self.max_anchors_per_pass = max(1, max_query_rows // self.block_size)
        self.grad_clip = grad_clip
        self.max_bad_steps = max_bad_steps
        self.activation_checkpointing = activation_checkpointing
        self.on_batch = on_batch
        self.shape = shape
        self.counters = DrafterCounters()
        self.in_optimizer_step = False
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self._metrics_size = objective.metrics_size  # the method's vector: objective.metrics and its own entries
        self._vector = torch.zeros(self._metrics_size + _NUM_EXTRA, dtype=torch.float64, device=device)
        self._extra = self._vector[self._metrics_size :]
        self._record_host: torch.Tensor | None = None  # pinned: the step's vector and gradient norm
        self._queued = None  # the queued step's record, read by the next read_record
        self._empty = None  # the empty pass of a sharded drafter with fewer passes than the busiest
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def step(self) -> int:
        """Optimizer steps taken (``Progress.step``)."""
        return self.progress.step

    def waited_for_features(self, seconds: float) -> None:
        """Time this drafter waited for the features of its batches (the monitor's wait share)."""
        self.counters.wait_s += seconds

    # ------------------------------------------------------------------ forward and backward
    def accumulate(self, deliveries: list[Delivery]) -> None:
        """Forward and backward of every pass of this drafter's share of the step; gradients accumulate
        (sharded: each pass's are reduce-scattered). Sharded, as many passes as the busiest drafter: the
        missing ones are empty."""
        dense = self.objective.dense_attention(self.device)
        plans = [(d, list(self.objective.passes(d.batch, self.max_anchors_per_pass, dense=dense))) for d in deliveries]
        own = sum(len(passes) for _, passes in plans)
        total = self.group.agree_max(own) if self.group.sharded else own
        for delivery, passes in plans:
            with self.health.compute_pass():
                self._train_on(delivery, passes)
        for _ in range(total - own):
            with self.health.compute_pass():
                self._empty_pass()

    def train_step(self, delivery: Delivery) -> None:
        """One step on one batch as the loop runs it (one drafter alone: ``plan --measure``): its passes, the
        record of the step before (read one step late), its update queued."""
        self.accumulate([delivery])
        self.read_record()
        self.queue_update()

    def _train_on(self, delivery: Delivery, passes) -> None:
        start = time.perf_counter()
        batch = delivery.batch
        for index, (part, blocks_host) in enumerate(passes):  # built on the host
            flops = drafter_flops_of_blocks(self.shape, blocks_host)
            self.counters.flops += flops
            self._extra[FLOPS] += flops
            with out_of_memory_context(self.device, lambda: self._pass_context(delivery, index, part, blocks_host)):
                blocks = blocks_host.pin_memory().to(self.device) if self.device.type == "cuda" else blocks_host
                features = delivery.features[part.token_lo : part.token_hi]
                with self._autocast():
                    loss_sum, metrics = self.objective(features, blocks)
                loss_sum.backward()
            self._vector[: self._metrics_size] += metrics
            self.counters.passes += 1
            self.health.check()
        self._extra[TOKENS] += batch.num_tokens
        self._extra[SAMPLES] += batch.num_docs
        self._extra[BATCHES] += 1
        self.counters.batches += 1
        self.counters.tokens += batch.num_tokens
        self.counters.samples += batch.num_docs
        self.counters.busy_s += time.perf_counter() - start
        if self.on_batch is not None:
            self.on_batch(self, delivery)

    def _empty_pass(self) -> None:
        """A pass through every sharded unit that adds nothing: its loss is multiplied by zero."""
        if self._empty is None:
            from draftline.data.batch import PackedBatch

            length = self.block_size + 2
            batch = PackedBatch.from_documents([(list(range(length)), [True] * length)], sample_ids=[0])
            blocks = self.objective.build(batch, torch.tensor([1])).to(self.device)  # the method's blocks
            width = self.objective.feature_width
            features = torch.zeros(length, width, device=self.device, dtype=self.compute_dtype)
            self._empty = features, blocks
        features, blocks = self._empty
        with self._autocast():
            loss_sum, _ = self.objective(features, blocks)
        (loss_sum * 0.0).backward()
        self.counters.empty_passes += 1

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32)

    def _pass_context(self, delivery: Delivery, index: int, part, blocks) -> OutOfMemoryContext:
        """What this drafter knows of the pass that ran out of memory (sizes, and what to lower)."""
        batch = delivery.batch
        rows = blocks.num_anchors * self.block_size
        return OutOfMemoryContext(
            where=f"the drafter's pass {index + 1} of batch {delivery.seq} (step {self.step + 1})",
            sizes=f"the batch: {batch.num_tokens:,} tokens in {batch.num_docs} documents; the pass: {rows:,} query rows "
                  f"({blocks.num_anchors} anchors x block {self.block_size}) over {part.token_hi - part.token_lo:,} "
                  f"context tokens; the features {tuple(delivery.features.shape)} {str(delivery.features.dtype)[6:]}",
            advice=f"lower --max-query-rows (now {self.max_anchors_per_pass * self.block_size:,}: the rows of one pass) "
                   f"or --token-budget (this batch: {batch.num_tokens:,} tokens)"
                   + ("" if self.activation_checkpointing else ", or enable --activation-checkpointing")
                   + "; preflight (on unless --no-preflight) measures the worst case before training",
            device=self.device)

    def _step_context(self) -> OutOfMemoryContext:
        num_params = sum(p.numel() for p in self.params)
        share = f" (this rank's 1/{self.group.num_drafters})" if self.group.sharded else ""
        return OutOfMemoryContext(
            where=f"the drafter's optimizer step {self.step + 1} (after its batches)",
            sizes=f"{num_params:,} trained parameters{share}: gradients {gib(4 * num_params / self.group.num_drafters)}, "
                  f"AdamW state {gib(8 * num_params / self.group.num_drafters)} (allocated at the first step)",
            advice="lower --token-budget or --max-query-rows to leave room for the optimizer state, or fewer "
                   "--draft-layers, or more drafters (their state is sharded); preflight (on unless --no-preflight) "
                   "measures the step before training",
            device=self.device)

    # ------------------------------------------------------------------ the update
    def queue_update(self, *, stop: bool = False, save: bool = False, time_up: bool = False, clock: float = 0.0) -> None:
        """Sum the step's metrics over the drafters, normalise, clip and queue AdamW without waiting for it.
        ``stop``/``save``/``time_up``: this drafter's flags, summed with the others' (any drafter's flag counts);
        ``clock``: the share of its time limit spent, averaged over the drafters (``StepRecord.clock``)."""
        start = time.perf_counter()
        with out_of_memory_context(self.device, self._step_context):
            extra = self._extra
            extra[STOP].fill_(1.0 if stop else 0.0)  # fill_: no host-to-device copy (a sync)
            extra[SAVE].fill_(1.0 if save else 0.0)
            extra[TIME_UP].fill_(1.0 if time_up else 0.0)
            extra[CLOCK].fill_(clock)
            self.group.reduce_gradients(self.params)  # replicated drafters: the step's gradient summed
            if self.group.sharded:
                extra[GRAD_SQ].copy_(grad_sq_norm(self.params))
            vector = self.group.all_reduce(self._vector.clone())
            scale = (1.0 / vector[WEIGHT_SUM].clamp_min(1e-12)).float()
            if self.group.sharded:
                norm = vector[self._metrics_size + GRAD_SQ].sqrt().float() * scale
            else:
                norm = grad_norm(self.params).to(scale.device) * scale
            factor = clip_factor(scale, norm, self.grad_clip)
            record = torch.cat([vector, norm.double().reshape(1)])
            # A step whose loss or gradient is not finite is left out by the fused AdamW itself, on a device
            # flag: the update is queued before the host knows. The record is copied before the update runs.
            bad = ~(torch.isfinite(norm) & torch.isfinite(vector[LOSS_SUM]))
            lr = self.scheduler.get_last_lr()[0]
            self._queued = (self.step + 1, lr, self._copy_record(record))
            self.in_optimizer_step = True  # a failure in here leaves the weights half-updated
            step_with_factor(self.optimizer, self.params, factor, skip=bad)  # scale and clip inside the update
            self.in_optimizer_step = False
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient memory during the next forward
        self._vector.zero_()
        self.progress.step_taken()
        self.counters.sync_s += time.perf_counter() - start

    def drop_gradients(self) -> None:
        """Forget the step being accumulated (a stop was agreed before it: it is not taken)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._vector.zero_()

    def read_record(self, *, check: bool = True) -> StepRecord | None:
        """The record of the step queued last, if not read yet (waits for its copy, not for the update), and
        its accounting: skipped steps, the gradient norm, the limit of bad steps in a row (``check``: raise
        when it is reached; a failure's checkpoint reads the last record with ``check=False``)."""
        if self._queued is None:
            return None
        start = time.perf_counter()
        (step, lr, values), self._queued = self._queued, None
        host = values()
        size = self._metrics_size
        record = StepRecord(step=step, metrics=host[:size], tokens=int(host[size + TOKENS]),
                            samples=int(host[size + SAMPLES]), batches=int(host[size + BATCHES]),
                            flops=float(host[size + FLOPS]), grad_norm=float(host[-1]), lr=lr,
                            stop=float(host[size + STOP]) > 0, save=float(host[size + SAVE]) > 0,
                            time_up=float(host[size + TIME_UP]) > 0,
                            clock=float(host[size + CLOCK]) / self.group.num_drafters)
        # The next steps' learning rate follows the clock the drafters agreed on (every drafter reads the same sum).
        self.progress.count(record)
        self.counters.bad_in_a_row = 0 if record.finite else self.counters.bad_in_a_row + 1
        self.counters.last_grad_norm = record.grad_norm
        self.counters.sync_s += time.perf_counter() - start
        if check and self.counters.bad_in_a_row >= self.max_bad_steps:
            raise DraftlineError(
                f"{self.counters.bad_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(last at step {step}); lower --lr, check the data, or resume from an earlier checkpoint"
            )
        return record

    def _copy_record(self, record: torch.Tensor):
        """Start copying ``record`` to the host; returns a call that waits for the copy and gives it (a CPU tensor).

        On CUDA the copy goes into pinned memory behind the work queued so far, so waiting for it does not
        wait for what is queued after it (the optimizer step, the next step's passes).
        """
        if self.device.type != "cuda":
            return lambda: record
        if self._record_host is None:
            self._record_host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        self._record_host.copy_(record, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def values() -> torch.Tensor:
            done.synchronize()
            return self._record_host.clone()  # the pinned buffer takes the next step's record

        return values

