"""The drafter role: take feature batches, train the drafter, finish optimizer steps together.

Step ``k`` is the batches numbered ``k*G .. (k+1)*G - 1`` (G = batches per step), whichever drafter
takes them. A drafter learns that step ``k`` is complete when it is handed a batch of a later step
(or the end): then all drafters all-reduce the summed gradients and metrics, divide the gradients
by the step's total label weight, clip, and step the optimizer. So the result of a step does not
depend on how its batches were spread over drafters or split into passes.

A batch runs in one or more passes of at most ``max_query_rows`` block rows, which the objective
plans and builds (``DFlashObjective.passes``: anchors, blocks, labels); each pass is one forward
(all blocks in one attention pass) and one backward.

The host runs one step ahead of the GPU. ``finish_step`` queues step ``k``'s update and returns
without waiting; the step's record (metrics, gradient norm, stop flag), copied to the host before its
update runs, is read when step ``k + 1`` is finished, after that step's batches were queued. So the
host prepares and launches the next step while the GPU still works on this one, and the GPU does not
wait for the host between steps. What the record decides comes one step late and is exact: a
non-finite step is left out by the update itself (a device flag), and when the drafters agreed at
step ``k`` to stop, step ``k + 1`` is not taken (its gradients are dropped; a resume trains its batches
again). ``settle`` reads the last record at the end of a run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from draftline.errors import DraftlineError
from draftline.model.fused import compile_drafter
from draftline.monitor.flops import DrafterShape, drafter_flops_of_blocks
from draftline.objective.loss import DFlashObjective
from draftline.objective.metrics import WEIGHT_SUM, metrics_size
from draftline.pipeline.health import Health
from draftline.pipeline.memory import OutOfMemoryContext, gib, out_of_memory_context
from draftline.pipeline.optim import grad_factor, step_with_factor
from draftline.pipeline.waits import wait_work
from draftline.pipeline.transport import Delivery, FeatureReceiver

# Extra entries appended to the metrics vector for the step all-reduce.
_EXTRA = ("tokens", "samples", "batches", "flops", "stop")


@dataclass
class DrafterCounters:
    """What this drafter did (host-side numbers for the monitor and the checkpoint)."""

    step: int = 0
    batches: int = 0
    tokens: int = 0
    samples: int = 0
    passes: int = 0
    flops: float = 0.0
    busy_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    last_loss: float = float("nan")
    last_grad_norm: float = float("nan")
    extra: dict = field(default_factory=dict)


class GradSync:
    """Sum gradients and a small metrics vector over the drafter ranks (nothing with one drafter)."""

    def __init__(self, params: list[torch.nn.Parameter], group, health: Health, bucket_mb: float = 64.0):
        self.params = params
        self.group = group
        self.health = health
        self.buckets: list[list[torch.nn.Parameter]] = []
        bucket: list[torch.nn.Parameter] = []
        size = 0
        limit = int(bucket_mb * 2**20)
        # Reverse definition order: the order in which backward finishes gradients.
        for p in reversed(params):
            bucket.append(p)
            size += p.numel() * 4
            if size >= limit:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)

    @property
    def active(self) -> bool:
        return self.group is not None

    def all_reduce(self, vector: torch.Tensor) -> torch.Tensor:
        """Sum ``vector`` and every parameter's gradient over the group, in place."""
        if self.group is None:
            return vector
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [dist.all_reduce(vector, group=self.group, async_op=True)]
        flats = []
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            flats.append(flat)
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        for work in works:
            wait_work(work, self.health)
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        return vector


class DrafterWorker:
    """Trains the drafter on what ``receiver`` hands over; see the module docstring."""

    def __init__(
        self,
        *,
        objective: DFlashObjective,
        optimizer: torch.optim.Optimizer,
        scheduler,
        receiver: FeatureReceiver,
        sync: GradSync,
        health: Health,
        device: torch.device,
        compute_dtype: torch.dtype,
        batches_per_step: int,
        start_step: int,
        total_steps: int,
        max_query_rows: int,
        grad_clip: float,
        max_bad_steps: int,
        activation_checkpointing: bool = False,
        compile_layers: bool = False,
        overlap_update: bool = False,
        on_step=None,
        on_batch=None,
        stop_requested=lambda: False,
    ):
        self.objective = objective
        self.drafter = objective.drafter
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.receiver = receiver
        self.sync = sync
        self.health = health
        self.device = device
        self.compute_dtype = compute_dtype
        self.batches_per_step = batches_per_step
        self.step = start_step
        self.total_steps = total_steps
        self.block_size = objective.block_size
        self.max_anchors_per_pass = max(1, max_query_rows // self.block_size)
        self.grad_clip = grad_clip
        self.max_bad_steps = max_bad_steps
        self.activation_checkpointing = activation_checkpointing
        self.on_step = on_step
        self.on_batch = on_batch
        self.stop_requested = stop_requested
        self.shape = DrafterShape.from_config(self.drafter.config)
        self.counters = DrafterCounters(step=start_step)
        self.in_optimizer_step = False
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        size = metrics_size(self.block_size)
        self._vector = torch.zeros(size + len(_EXTRA), dtype=torch.float64, device=device)
        self._metrics_size = size
        self._record_host: torch.Tensor | None = None  # pinned: the step's metrics vector and gradient norm
        self._queued = None  # the queued step's record, read by the next finish_step or settle
        if compile_layers and device.type == "cuda":
            compile_drafter(self.drafter)  # fused norms/RoPE/SwiGLU, fewer saved activations
        if activation_checkpointing:
            _checkpoint_layers(self.drafter)
        self._update_stream = None
        if overlap_update and device.type == "cuda":
            self._overlap_update()
        health.watch(self.drafter.layers)

    def _overlap_update(self) -> None:
        """Run AdamW on a second stream, one chunk per decoder layer (and one for the rest: ``fc`` and the
        norms), so the next step's forward starts while later layers are still being updated: each layer
        (a forward pre-hook) waits for its own chunk's event only. Experimental: not measured yet."""
        self._update_stream = torch.cuda.Stream(self.device)
        layers = [[p for p in layer.parameters() if p.requires_grad] for layer in self.drafter.layers]
        in_layers = {p for chunk in layers for p in chunk}
        self._update_chunks = [[p for p in self.params if p not in in_layers], *layers]
        self._update_events = [torch.cuda.Event() for _ in self._update_chunks]

        def waits_for(index: int):
            def hook(_module, _args):
                torch.cuda.current_stream(self.device).wait_event(self._update_events[index])
            return hook

        self.drafter.register_forward_pre_hook(waits_for(0))
        for i, layer in enumerate(self.drafter.layers):
            layer.register_forward_pre_hook(waits_for(i + 1))

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        """Train until the batches run out, ``total_steps`` is reached or a stop is agreed.

        Returns 'finished' or 'stopped'.
        """
        self.optimizer.zero_grad(set_to_none=True)
        while self.step < self.total_steps:
            delivery, waited = self.receiver.get()
            self.counters.wait_s += waited
            boundary = self.total_steps if delivery is None else delivery.seq // self.batches_per_step
            while self.step < min(boundary, self.total_steps):
                if self.finish_step():
                    return "stopped"
            if delivery is None or self.step >= self.total_steps:
                break
            with self.health.compute_pass():
                self.train_on(delivery)
        self.settle()  # the last step's record; a stop agreed there ends the run where it ends anyway
        return "finished"

    def train_on(self, delivery: Delivery) -> None:
        start = time.perf_counter()
        batch = delivery.batch
        dense = self.objective.dense_attention(self.device)
        for index, (part, blocks_host) in enumerate(self.objective.passes(batch, self.max_anchors_per_pass, dense=dense)):  # host
            flops = drafter_flops_of_blocks(self.shape, blocks_host)
            self.counters.flops += flops
            self._vector[self._metrics_size + 3] += flops
            with out_of_memory_context(self.device, lambda: self._pass_context(delivery, index, part, blocks_host)):
                blocks = blocks_host.pin_memory().to(self.device) if self.device.type == "cuda" else blocks_host
                features = delivery.features[part.token_lo : part.token_hi]
                with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
                    loss_sum, metrics = self.objective(features, blocks)
                loss_sum.backward()
            self._vector[: self._metrics_size] += metrics
            self.counters.passes += 1
            self.health.check()
        tokens = batch.num_tokens
        extra = self._vector[self._metrics_size :]
        extra[0] += tokens
        extra[1] += batch.num_docs
        extra[2] += 1
        self.counters.batches += 1
        self.counters.tokens += tokens
        self.counters.samples += batch.num_docs
        self.counters.busy_s += time.perf_counter() - start
        if self.on_batch is not None:
            self.on_batch(self, delivery)

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
        return OutOfMemoryContext(
            where=f"the drafter's optimizer step {self.step + 1} (after its batches)",
            sizes=f"{num_params:,} trained parameters: gradients {gib(4 * num_params)}, AdamW state "
                  f"{gib(8 * num_params)} (allocated at the first step)",
            advice="lower --token-budget or --max-query-rows to leave room for the optimizer state, or fewer "
                   "--draft-layers; preflight (on unless --no-preflight) measures the step before training",
            device=self.device)

    def finish_step(self) -> bool:
        """Read the step queued before (``settle``), then all-reduce, normalise, clip and queue this
        step's update without waiting for it.

        Returns True when the drafters agreed to stop at the step before: this step is then not taken
        (its gradients are dropped, ``step`` stays) and its batches are trained again after a resume.
        """
        if self.settle():
            self.optimizer.zero_grad(set_to_none=True)
            self._vector.zero_()
            return True
        with out_of_memory_context(self.device, self._step_context):
            self._queue_step()
        return False

    def _queue_step(self) -> None:
        start = time.perf_counter()
        self._vector[-1].fill_(1.0 if self.stop_requested() else 0.0)  # fill_: no host-to-device copy (sync)
        vector = self.sync.all_reduce(self._vector.clone())
        weight = vector[WEIGHT_SUM]
        scale = (1.0 / weight.clamp_min(1e-12)).float()
        factor, norm = grad_factor(self.params, scale, self.grad_clip)
        record = torch.cat([vector, norm.double().reshape(1)])  # the step's metrics vector, its gradient norm
        # A step whose loss or gradient is not finite is left out by the fused AdamW itself, on a device
        # flag: the update is queued before the host knows. The record is copied before the update runs.
        bad = ~(torch.isfinite(norm) & torch.isfinite(vector[0]))
        self._queued = self._copy_record(record)
        self.in_optimizer_step = True  # a failure in here leaves the weights half-updated
        if self._update_stream is None:
            step_with_factor(self.optimizer, self.params, factor, skip=bad)  # scale and clip inside the update
        else:
            self._update_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._update_stream):
                step_with_factor(self.optimizer, self.params, factor, skip=bad, chunks=self._update_chunks,
                                 after_chunk=lambda i: self._update_events[i].record())
            for t in [factor, bad, *(p.grad for p in self.params if p.grad is not None)]:
                t.record_stream(self._update_stream)  # freed below on the host, still read there
        self.in_optimizer_step = False
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient memory during the next forward
        self._vector.zero_()
        self.step += 1
        self.counters.step = self.step
        self.counters.sync_s += time.perf_counter() - start

    def settle(self, notify: bool = True) -> bool:
        """Wait for the record of the step queued last (if not read yet) and account it: skipped steps,
        gradient norm, ``on_step``, the limit of bad steps in a row. Returns True when the drafters agreed
        at that step to stop. ``finish_step`` calls it; call it once more after the last step.
        ``notify=False`` (before a failure's checkpoint): the counts only, no ``on_step``, no raise."""
        if self._update_stream is not None:  # what is queued next (a checkpoint's copies) sees the update
            torch.cuda.current_stream(self.device).wait_stream(self._update_stream)
        if self._queued is None:
            return False
        start = time.perf_counter()
        queued, self._queued = self._queued, None
        host = queued()
        if math.isfinite(float(host[0])) and math.isfinite(float(host[-1])):
            self.counters.bad_in_a_row = 0
        else:
            self.counters.skipped_steps += 1
            self.counters.bad_in_a_row += 1
        self.counters.last_grad_norm = float(host[-1])
        self.counters.sync_s += time.perf_counter() - start
        stop = float(host[-2]) > 0  # the all-reduced stop flag
        if not notify:
            return stop
        if self.on_step is not None:
            self.on_step(self, host[:-1])  # on the host: the monitor reads it without waiting for the GPU
        if self.counters.bad_in_a_row >= self.max_bad_steps:
            raise DraftlineError(
                f"{self.counters.bad_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(last at step {self.step}); lower --lr, check the data, or resume from an earlier checkpoint"
            )
        return stop

    def _copy_record(self, record: torch.Tensor):
        """Start copying ``record`` to the host; returns a call that waits for the copy and gives it (a CPU tensor).

        On CUDA the copy goes into pinned memory behind the work queued so far, so waiting for it does not
        wait for what is queued after it (the optimizer step).
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


def _checkpoint_layers(drafter) -> None:
    """Recompute each decoder layer in backward instead of storing its activations."""
    from torch.utils.checkpoint import checkpoint

    for layer in drafter.layers:
        forward = layer.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped
