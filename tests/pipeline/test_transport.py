"""The target's outbox: a send thread that dies surfaces in ``put`` and ``finish`` instead of
leaving them blocked on a full outbox."""

from __future__ import annotations

import os
import threading

import torch

from draftline.distributed.health import Health, RankInfo
from draftline.pipeline.transport import DistributedSender


class _ClaimsThatFailLater:
    """The first claim lookup waits for ``fail`` to be set, then raises (the store went away)."""

    def __init__(self):
        self.fail = threading.Event()

    def claimant(self, seq):
        self.fail.wait()
        raise ConnectionError("store unreachable")


def _in_thread(fn) -> list:
    outcome: list = []

    def body():
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "blocked on a full outbox whose send thread had died"
    return outcome


def test_a_dead_send_thread_surfaces_in_put_and_finish():
    health = Health(RankInfo(1, "target", "here", "CPU", os.getpid()))
    claims = _ClaimsThatFailLater()
    sender = DistributedSender(claims, capacity=1, health=health)
    features = torch.zeros(4, 2)
    sender.put(0, features, None)  # the send thread takes it and waits in the claim lookup
    sender.put(1, features, None)  # fills the outbox (capacity 1)
    threading.Timer(0.2, claims.fail.set).start()  # the thread dies while the next put is blocked
    assert isinstance(_in_thread(lambda: sender.put(2, features, None))[0], ConnectionError)
    assert isinstance(_in_thread(sender.finish)[0], ConnectionError)


def test_open_transport_gives_each_role_its_ends():
    import torch.distributed as dist

    from draftline.distributed.roles import assign_roles
    from draftline.pipeline.transport import DistributedReceiver, InProcessChannel, open_transport

    health = Health(RankInfo(0, "colocated", "here", "CPU", os.getpid()))
    colocated = assign_roles(1, 1, 1, colocated=True)[0]
    sender, receiver = open_transport(colocated, health, q_hs=3)
    assert isinstance(sender, InProcessChannel) and receiver is sender and sender.queue.maxsize == 3

    store = dist.HashStore()
    drafter, target_a, _ = assign_roles(3, 2, 1, colocated=False)
    sender, receiver = open_transport(target_a, health, q_hs=5, store=store)
    assert isinstance(sender, DistributedSender) and receiver is None
    assert sender.outbox.maxsize == 3  # its share of q_hs, rounded up
    sender, receiver = open_transport(drafter, health, q_hs=5, store=store, drafter_seqs=[0, 1, 2],
                                      batch_for=None, feature_width=8, device=torch.device("cpu"), dtype=torch.float32)
    assert sender is None and isinstance(receiver, DistributedReceiver)
    assert [receiver.target_rank(seq) for seq in range(4)] == [1, 2, 1, 2]  # round robin over the targets
    assert receiver.claims.claim(0) == 0 and store.get("claim/0") == b"0"
