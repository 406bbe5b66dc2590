"""Role assignment: which rank runs the target and which trains the drafter.

A pure function of the world size and the requested split, tested without a process group.
Ranks ``0 .. D-1`` train the drafter, ``D .. D+T-1`` run the target. Colocated, every rank does both
(a target thread feeds the drafter of its own process): one rank alone, or N ranks with
``--colocated``, whose drafters then train data-parallel. Rank 0, always a drafter, is the logging
rank: it owns the run directory, prints the monitor, writes metrics and checkpoints.

Which rank handles which batch is fixed too: batch numbers go round robin (``producer_of``) to the
targets; an optimizer step's consecutive numbers are dealt round robin to the drafters
(``drafter_share``), so every drafter has a share of every step and the drafters compute in
parallel. A fresh start makes the step a multiple of the drafters (``spec.default_batches_per_step``);
a resume on another number of drafters keeps the checkpoint's step, and the shares may then differ
by one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftline.errors import DraftlineError

TARGET = "target"
DRAFTER = "drafter"
COLOCATED = "colocated"


@dataclass(frozen=True)
class Role:
    rank: int
    kind: str  # TARGET, DRAFTER or COLOCATED
    index: int  # position among the ranks of its kind
    num_targets: int
    num_drafters: int

    @property
    def is_target(self) -> bool:
        return self.kind in (TARGET, COLOCATED)

    @property
    def is_drafter(self) -> bool:
        return self.kind in (DRAFTER, COLOCATED)

    @property
    def is_logging(self) -> bool:
        return self.is_drafter and self.index == 0

    def target_rank(self, target_index: int) -> int:
        return self.num_drafters + target_index if self.kind != COLOCATED else target_index

    def drafter_rank(self, drafter_index: int) -> int:
        return drafter_index

    @property
    def drafter_ranks(self) -> list[int]:
        return [self.drafter_rank(i) for i in range(self.num_drafters)]


def split(world_size: int, targets: int | None, drafters: int | None, target_share: float | None = None,
          colocated: bool = False) -> tuple[int, int]:
    """(targets, drafters) for ``world_size`` ranks.

    Either count may be given (the other is the rest). With neither, ``target_share`` (the
    target's share of the work per sample, from the FLOP model) picks a balanced split.
    ``colocated``: every rank runs both, so both counts are the world size.
    """
    if colocated and world_size > 1:
        if (targets or world_size) != world_size or (drafters or world_size) != world_size:
            raise DraftlineError(
                f"--colocated runs a target and a drafter on each of the {world_size} processes; "
                f"drop --targets {targets} / --drafters {drafters}, or drop --colocated for a split"
            )
        return world_size, world_size
    if world_size == 1:
        if (targets or 1) != 1 or (drafters or 1) != 1:
            raise DraftlineError(
                f"one process runs target and drafter together (colocated); --targets {targets} --drafters {drafters} "
                "needs that many processes: launch with --gpus N or torchrun --nproc-per-node N"
            )
        return 1, 1
    if targets is None and drafters is None:
        share = 0.5 if target_share is None else target_share
        targets = min(world_size - 1, max(1, round(world_size * share)))
    if targets is None:
        targets = world_size - drafters
    if drafters is None:
        drafters = world_size - targets
    if targets < 1 or drafters < 1 or targets + drafters != world_size:
        raise DraftlineError(
            f"--targets {targets} + --drafters {drafters} must add up to the {world_size} launched processes, "
            "each at least 1"
        )
    return targets, drafters


def assign_roles(world_size: int, num_targets: int, num_drafters: int, colocated: bool = False) -> list[Role]:
    """One Role per rank."""
    if world_size == 1 or colocated:
        return [Role(i, COLOCATED, i, world_size, world_size) for i in range(world_size)]
    if num_targets + num_drafters != world_size:
        raise DraftlineError(f"{num_targets} targets + {num_drafters} drafters != world size {world_size}")
    roles = [Role(i, DRAFTER, i, num_targets, num_drafters) for i in range(num_drafters)]
    roles += [Role(num_drafters + i, TARGET, i, num_targets, num_drafters) for i in range(num_targets)]
    return roles


def producer_of(seq: int, count: int) -> int:
    """Index of the target (or drafter) among ``count`` that handles batch ``seq``: round robin."""
    return seq % count


def drafter_share(step: int, batches_per_step: int, end_seq: int, index: int, num_drafters: int) -> list[int]:
    """The batch numbers of optimizer step ``step`` that drafter ``index`` of ``num_drafters`` trains:
    the step's ``k``-th batch goes to drafter ``k % num_drafters``; batches from ``end_seq`` on are not
    trained."""
    first = step * batches_per_step
    return list(range(first + index, min(first + batches_per_step, end_seq), num_drafters))


def drafter_seqs(start_step: int, total_steps: int, batches_per_step: int, end_seq: int, index: int,
                 num_drafters: int):
    """Every batch number drafter ``index`` trains from ``start_step`` on, in order."""
    for step in range(start_step, total_steps):
        yield from drafter_share(step, batches_per_step, end_seq, index, num_drafters)

