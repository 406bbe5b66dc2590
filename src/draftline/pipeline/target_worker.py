"""The target role: token batches in, fused features out, as fast as the drafters take them.

A prefetch thread builds this target's batches (``seq = t, t + T, t + 2T, ...``) from the dataset
into ``q_pre``, so the GPU never waits on the host; the main loop runs the frozen target on each and
hands the features to the transport, which blocks when the hidden-state queue is full.

In a target group (``--target-parallel`` K > 1) every rank of the group builds the same batches from its own copy
of the dataset (nothing is broadcast: the batch plan is deterministic), agrees with the others on each batch
(``TargetGroup.agree_next``) and runs its part of the forward; each rank ends with the same features, which its
sender hands on (the group's first rank to the drafters; colocated, each rank its own drafter's batches).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from draftline.data.batch import PackedBatch
from draftline.distributed.health import Health, RunAborted
from draftline.distributed.memory import OutOfMemoryContext, out_of_memory_context
from draftline.distributed.target_group import TargetGroup
from draftline.distributed.waits import queue_get
from draftline.pipeline.transport import FeatureSender
from draftline.sizing.flops import target_flops
from draftline.sizing.shapes import TargetShape


@dataclass
class TargetCounters:
    batches: int = 0
    tokens: int = 0
    samples: int = 0
    flops: float = 0.0
    busy_s: float = 0.0
    wait_data_s: float = 0.0
    wait_drafters_s: float = 0.0


class Prefetcher:
    """Builds batches ahead in a thread; ``get`` returns them in order (None at the end)."""

    def __init__(self, seqs: Iterable[int], load: Callable[[int], PackedBatch], capacity: int, health: Health):
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.health = health
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fill, args=(iter(seqs), load), name="draftline-q_pre", daemon=True)
        self.thread.start()

    def _fill(self, seqs, load) -> None:
        try:
            for seq in seqs:
                batch = load(seq)
                if torch.cuda.is_available():
                    batch = replace(batch, input_ids=batch.input_ids.pin_memory())
                while True:
                    if self.health.aborted:
                        return
                    try:
                        self.queue.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        continue
            self.queue.put(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread by get()
            self.error = exc
            self.queue.put(None)

    def get(self) -> tuple[PackedBatch | None, float]:
        item, waited = queue_get(self.queue, self.health)
        if self.error is not None:
            raise self.error
        return item, waited

    def depth(self) -> int:
        return self.queue.qsize()


class TargetWorker:
    def __init__(self, *, features, prefetcher: Prefetcher, sender: FeatureSender, health: Health,
                 shape: TargetShape, layers_run: int, on_batch=None, device: torch.device | None = None,
                 group: TargetGroup | None = None):
        """``group``: this rank's target group (``--target-parallel`` K > 1), whose ranks agree on each batch before
        running it together; None with one rank per target (nothing agreed)."""
        self.features = features
        self.prefetcher = prefetcher
        self.sender = sender
        self.health = health
        self.shape = shape
        self.layers_run = layers_run
        self.on_batch = on_batch
        self.device = device
        self.group = group
        self.counters = TargetCounters()
        # Held during each feature pass: the colocated evaluation decodes with the same model.
        self.model_lock = threading.Lock()

    def _pass_context(self, batch: PackedBatch) -> OutOfMemoryContext:
        """What this target knows of the pass that ran out of memory (sizes, and what to lower)."""
        return OutOfMemoryContext(
            where=f"the target's pass of batch {batch.index}",
            sizes=f"the batch: {batch.num_tokens:,} tokens in {batch.num_docs} documents, longest "
                  f"{int(batch.doc_lengths.max()) if batch.num_docs else 0:,}; {self.sender.depth()} feature batches "
                  "waiting in its outbox",
            advice="lower --token-budget (this batch: "
                   f"{batch.num_tokens:,} tokens) or --q-hs (feature batches held until a drafter takes them); "
                   "preflight (on unless --no-preflight) measures the worst case before training",
            device=self.device)

    @contextmanager
    def paused(self):
        """No feature pass runs while this is held (a pass in progress finishes first)."""
        with self.model_lock:
            yield

    def run(self) -> None:
        while True:
            batch, waited = self.prefetcher.get()
            self.counters.wait_data_s += waited
            if self.group is not None:  # a stopped peer ends this wait (it polls health), not a forward's all-reduce
                self.counters.wait_drafters_s += self.group.agree_next(None if batch is None else batch.index)
            if batch is None:
                break
            start = time.perf_counter()
            with out_of_memory_context(self.device, lambda: self._pass_context(batch)):
                with self.model_lock, self.health.compute_pass():
                    feats = self.features(batch)
                self.counters.busy_s += time.perf_counter() - start
                self.counters.wait_drafters_s += self.sender.put(batch.index, feats, batch)
            self.counters.batches += 1
            self.counters.tokens += batch.num_tokens
            self.counters.samples += batch.num_docs
            self.counters.flops += target_flops(self.shape, batch.doc_lengths, self.layers_run)
            if self.on_batch is not None:
                self.on_batch(self)
        self.sender.finish()


def run_target_thread(worker: TargetWorker, health: Health) -> threading.Thread:
    """Run a target worker in a thread (colocated mode); a failure aborts the run with its cause."""
    from draftline.distributed.health import describe_exception

    def body():
        try:
            worker.run()
        except RunAborted:
            pass
        except BaseException as exc:  # noqa: BLE001
            # This rank failed: its drafter thread stops with the message, its peers name this rank.
            health.report_failure(f"{describe_exception(exc)} (in its target thread)")
            worker.error = exc

    worker.error = None
    thread = threading.Thread(target=body, name="draftline-target", daemon=True)
    thread.start()
    return thread
