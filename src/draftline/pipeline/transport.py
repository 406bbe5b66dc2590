"""Moving features from targets to drafters: an interface and its two implementations.

- ``InProcessChannel``: one target thread and one drafter in the same process (colocated, one GPU
  or CPU). A bounded ``queue.Queue`` is the hidden-state queue.
- ``StoreClaims`` + ``DistributedSender`` / ``DistributedReceiver``: targets and drafters are ranks
  of one ``torch.distributed`` job. A drafter with room CLAIMS its next batch number (each step's
  batches are dealt round robin to the drafters, so they all compute in parallel) in the job's
  store, then posts a receive from the target that computes that number; the target, once the
  batch is computed, learns the claimant from the store and sends the features GPU to GPU (NCCL;
  gloo on CPU). The hidden-state queue is the
  targets' outboxes: computed batches waiting for a claim, bounded, so targets feel back-pressure.

Only the features travel: the drafter rebuilds batch ``seq`` (tokens, loss mask, documents) from
its own copy of the dataset and the deterministic batch schedule.

A target group (``--target-parallel`` K > 1) sends from one rank: every rank of the group ends its forward with the
same features, and its first rank sends them as a target alone does; the others drop theirs (``GroupShareSender``).
One sender keeps the transport of a rank per target unchanged (one claim, one send per batch, the drafter's receive
as before); sending K disjoint column slices from the K ranks would split a send's time by K over links that the
target's own all-reduces already use, a gain that only a measurement on the GPUs could show, and would cost K
claims, K receives and a concatenation per batch on the drafter.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist

from draftline.data.batch import PackedBatch
from draftline.distributed import keys
from draftline.distributed.health import Health, RunAborted
from draftline.distributed.memory import OutOfMemoryContext, out_of_memory_context
from draftline.distributed.roles import COLOCATED, Role, drafter_of, producer_of
from draftline.distributed.waits import queue_get, queue_put, wait_for, wait_work

RECEIVE_PREFETCH = 2
"""Batches a drafter claims ahead of the one it trains (their features are received meanwhile)."""


@dataclass
class Delivery:
    """A batch of features handed to a drafter."""

    seq: int
    features: torch.Tensor  # [T, K * H] on the drafter's device
    batch: PackedBatch


class FeatureSender(Protocol):
    def put(self, seq: int, features: torch.Tensor, batch: PackedBatch) -> float:
        """Queue features for a drafter; blocks while the queue is full. Returns seconds blocked."""

    def finish(self) -> None:
        """No more batches from this target; returns once everything queued was taken."""

    def depth(self) -> int: ...


class FeatureReceiver(Protocol):
    def get(self) -> tuple[Delivery | None, float]:
        """The next batch for this drafter (None when the run has no more) and seconds waited."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the transport: ``{"in_flight": [...]}``, the batches claimed and not
        handed over yet (for the record: a resume recomputes them from the checkpoint's step)."""

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a resume claims its batches afresh."""

    def depth(self) -> int: ...


# --------------------------------------------------------------------------- in-process
_END = object()


class InProcessChannel:
    """Bounded hidden-state queue between a target thread and a drafter in one process."""

    def __init__(self, capacity: int, health: Health):
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.health = health

    def put(self, seq: int, features: torch.Tensor, batch: PackedBatch) -> float:
        return queue_put(self.queue, Delivery(seq, features, batch), self.health)

    def finish(self) -> None:
        queue_put(self.queue, _END, self.health)

    def get(self) -> tuple[Delivery | None, float]:
        item, waited = queue_get(self.queue, self.health)
        return (None if item is _END else item), waited

    def depth(self) -> int:
        return self.queue.qsize()

    def state_dict(self) -> dict:
        return {"in_flight": []}  # the queue's batches are this process's own: recomputed after a resume

    def load_state_dict(self, state: dict) -> None:
        pass


# --------------------------------------------------------------------------- distributed
class StoreClaims:
    """Who trains which batch, published in the job's store.

    A drafter claims its own batch numbers (``seqs``, round robin among the drafters) in order as
    it has room; the target computing a batch looks up the claimant before sending.
    """

    def __init__(self, store, seqs: Iterable[int] = ()):
        self.store = store
        self._seqs = iter(seqs)

    def claim(self, drafter_rank: int) -> int | None:
        seq = next(self._seqs, None)
        if seq is None:
            return None
        self.store.set(keys.claim_key(seq), str(drafter_rank))
        return seq

    def claimant(self, seq: int) -> int | None:
        key = keys.claim_key(seq)
        if not self.store.check([key]):
            return None
        rank = int(self.store.get(key))
        self.store.delete_key(key)
        return rank


class DistributedSender:
    """A target's outbox: computed features wait here until a drafter claims them.

    A background thread sends in batch order; ``put`` blocks while ``capacity`` batches wait.
    """

    def __init__(self, claims: StoreClaims, capacity: int, health: Health):
        self.claims = claims
        self.health = health
        self.outbox: queue.Queue = queue.Queue(maxsize=capacity)
        self.error: BaseException | None = None
        self.bytes_sent = 0
        self.send_seconds = 0.0
        self.thread = threading.Thread(target=self._send_loop, name="draftline-sender", daemon=True)
        self.thread.start()

    def put(self, seq: int, features: torch.Tensor, batch: PackedBatch) -> float:
        return queue_put(self.outbox, (seq, features), self.health, check=self._raise_if_failed)

    def finish(self) -> None:
        queue_put(self.outbox, None, self.health, check=self._raise_if_failed)
        while self.thread.is_alive():
            self._raise_if_failed()
            self.health.check()
            self.thread.join(timeout=0.05)
        self._raise_if_failed()

    def depth(self) -> int:
        return self.outbox.qsize()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _send_loop(self) -> None:
        try:
            while True:
                item = self.outbox.get()
                if item is None:
                    return
                seq, features = item
                holder: list[int | None] = [None]

                def claimed() -> bool:
                    holder[0] = self.claims.claimant(seq)
                    return holder[0] is not None

                wait_for(claimed, self.health, max_sleep_s=0.005)
                start = time.perf_counter()
                work = dist.isend(features, dst=holder[0])
                wait_work(work, self.health)
                self.send_seconds += time.perf_counter() - start
                self.bytes_sent += features.numel() * features.element_size()
        except RunAborted:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by put/finish
            self.error = exc


class DistributedReceiver:
    """A drafter's side: claim batch numbers, post receives, hand over completed batches in order."""

    def __init__(
        self,
        claims: StoreClaims,
        *,
        rank: int,
        target_rank: Callable[[int], int],
        prefetch: int,
        batch_for: Callable[[int], PackedBatch],
        feature_width: int,
        device: torch.device,
        dtype: torch.dtype,
        health: Health,
    ):
        self.claims = claims
        self.rank = rank
        self.target_rank = target_rank  # batch number -> rank of the target that computes it
        self.prefetch = max(1, prefetch)
        self.batch_for = batch_for
        self.feature_width = feature_width
        self.device = device
        self.dtype = dtype
        self.health = health
        self.pending: list[tuple[int, PackedBatch, torch.Tensor, object]] = []
        self.exhausted = False

    def _top_up(self) -> None:
        while not self.exhausted and len(self.pending) < self.prefetch:
            seq = self.claims.claim(self.rank)
            if seq is None:
                self.exhausted = True
                return
            batch = self.batch_for(seq)
            with out_of_memory_context(self.device, lambda: self._buffer_context(seq, batch)):
                buffer = torch.empty(batch.num_tokens, self.feature_width, device=self.device, dtype=self.dtype)
            work = dist.irecv(buffer, src=self.target_rank(seq))
            self.pending.append((seq, batch, buffer, work))

    def _buffer_context(self, seq: int, batch: PackedBatch) -> OutOfMemoryContext:
        return OutOfMemoryContext(
            where=f"the drafter's receive buffer for batch {seq}",
            sizes=f"the batch: {batch.num_tokens:,} tokens in {batch.num_docs} documents; its features "
                  f"{batch.num_tokens:,} x {self.feature_width:,} {str(self.dtype)[6:]}; {len(self.pending)} "
                  "batches already received or in flight",
            advice="lower --token-budget (the features of a batch are token_budget x their width)",
            device=self.device)

    def get(self) -> tuple[Delivery | None, float]:
        self._top_up()
        if not self.pending:
            return None, 0.0
        seq, batch, buffer, work = self.pending.pop(0)
        waited = wait_work(work, self.health)
        self._top_up()  # claim the next one before computing on this one
        return Delivery(seq, buffer, batch), waited

    @property
    def claimed(self) -> list[int]:
        """Batch numbers claimed and not yet handed over (in flight)."""
        return [seq for seq, *_ in self.pending]

    def depth(self) -> int:
        return len(self.pending)

    def state_dict(self) -> dict:
        return {"in_flight": self.claimed}

    def load_state_dict(self, state: dict) -> None:
        pass


# --------------------------------------------------------------------------- a target group's ranks
class GroupShareSender:
    """A rank of a target group hands on only the features it owns (every rank of the group computes the same ones):
    colocated, those of its own drafter's batches (``keeps``) into its in-process channel; a rank other than its
    group's sender, none (``inner`` None: the group's first rank sends them)."""

    def __init__(self, inner: FeatureSender | None, keeps: Callable[[int], bool] = lambda seq: True):
        self.inner = inner
        self.keeps = keeps

    def put(self, seq: int, features: torch.Tensor, batch: PackedBatch) -> float:
        if self.inner is None or not self.keeps(seq):
            return 0.0
        return self.inner.put(seq, features, batch)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()

    def depth(self) -> int:
        return self.inner.depth() if self.inner is not None else 0


# --------------------------------------------------------------------------- choosing one
def open_transport(
    role: Role,
    health: Health,
    *,
    q_hs: int,
    store=None,
    drafter_seqs: Iterable[int] = (),
    batch_for: Callable[[int], PackedBatch] | None = None,
    feature_width: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    batches_per_step: int = 1,
) -> tuple[FeatureSender | None, FeatureReceiver | None]:
    """The sending end (a target) and the receiving end (a drafter) this rank's role needs.

    Colocated, one in-process channel is both ends (in a target group the channel takes only this rank's own
    drafter's batches, of ``batches_per_step`` a step). Otherwise a target, or a target group's sending rank, gets
    an outbox of its share of ``q_hs`` batches (the group's other ranks send nothing); a drafter claims
    ``drafter_seqs`` in the store and receives each batch from the rank that sends it (rebuilding the batch itself
    with ``batch_for``).
    """
    if role.kind == COLOCATED:
        channel = InProcessChannel(q_hs, health)
        if role.target_parallel > 1:
            own = functools.partial(_owned, batches_per_step=batches_per_step, role=role)
            return GroupShareSender(channel, own), channel
        return channel, channel
    if role.is_target:
        if not role.sends:
            return GroupShareSender(None), None
        capacity = max(1, -(-q_hs // role.num_target_groups))
        return DistributedSender(StoreClaims(store), capacity, health), None
    receiver = DistributedReceiver(
        StoreClaims(store, drafter_seqs), rank=role.rank,
        target_rank=lambda seq: role.sender_rank(producer_of(seq, role.num_target_groups)),
        prefetch=RECEIVE_PREFETCH, batch_for=batch_for, feature_width=feature_width, device=device, dtype=dtype, health=health,
    )
    return None, receiver


def _owned(seq: int, *, batches_per_step: int, role: Role) -> bool:
    """Whether batch ``seq`` is this colocated rank's own drafter's."""
    return drafter_of(seq, batches_per_step, role.num_drafters) == role.index
