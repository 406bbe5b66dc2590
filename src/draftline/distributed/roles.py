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

Target groups (``--target-parallel K``): a target too large for one GPU runs tensor-parallel on K ranks. The
target ranks ``D .. D+T-1`` form ``T / K`` groups of K consecutive ranks; batch numbers go round robin to the
groups, every rank of a group computes each of the group's batches (the same features on each), and the group's
first rank sends them (``sender_rank``). Colocated, ranks ``gK .. gK+K-1`` form group ``g``: the group computes
the batches of its K drafters (``group_seqs``) and each rank keeps its own drafter's. With K = 1 every number
here is the one of a rank per target: group ``g`` is target ``g``, its sender that target's rank.
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
    num_targets: int  # target ranks (every rank of every target group)
    num_drafters: int
    target_parallel: int = 1
    """Ranks per target group (the target split tensor-parallel over them); 1: a whole target per rank."""

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

    # ---------------------------------------------------------------- target groups
    @property
    def num_target_groups(self) -> int:
        """Targets as the batches see them: groups of ``target_parallel`` ranks (the target ranks with K = 1)."""
        return self.num_targets // self.target_parallel

    @property
    def target_group(self) -> int | None:
        """The index of this rank's target group (None on a drafter-only rank)."""
        return self.index // self.target_parallel if self.is_target else None

    @property
    def group_rank(self) -> int:
        """This target rank's position in its group (0: the one that sends the group's features)."""
        return self.index % self.target_parallel

    @property
    def sends(self) -> bool:
        """A target rank that sends its group's features to the drafters (its group's first rank)."""
        return self.kind == TARGET and self.group_rank == 0

    def sender_rank(self, group: int) -> int:
        """The rank that sends target group ``group``'s features (with K = 1: that target's rank)."""
        return self.target_rank(group * self.target_parallel)

    def group_ranks(self, group: int) -> list[int]:
        """The ranks of target group ``group``, in group order."""
        return [self.target_rank(group * self.target_parallel + i) for i in range(self.target_parallel)]

    def all_target_groups(self) -> list[list[int]]:
        """Every target group's ranks, in group order: the order in which every rank creates their process groups."""
        return [self.group_ranks(g) for g in range(self.num_target_groups)]

    def describe_group(self) -> str:
        """How a message names this rank's place in its target group ("" with one rank per target)."""
        if self.target_parallel == 1 or not self.is_target:
            return ""
        return f"target group {self.target_group}, its rank {self.group_rank} of {self.target_parallel}"

    @property
    def drafter_ranks(self) -> list[int]:
        return [self.drafter_rank(i) for i in range(self.num_drafters)]


def split(world_size: int, targets: int | None, drafters: int | None, target_share: float | None = None,
          colocated: bool = False, target_parallel: int = 1) -> tuple[int, int]:
    """(target ranks, drafters) for ``world_size`` ranks.

    Either count may be given (the other is the rest). With neither, ``target_share`` (the
    target's share of the work per sample, from the FLOP model) picks a balanced split.
    ``colocated``: every rank runs both, so both counts are the world size. ``target_parallel``: ranks per
    target group; the target ranks are a multiple of it.
    """
    k = target_parallel
    if k > 1:
        _check_groups(world_size, targets, drafters, colocated, k)
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
        groups = min((world_size - 1) // k, max(1, round(world_size * share / k)))
        targets = groups * k
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


def _check_groups(world_size: int, targets: int | None, drafters: int | None, colocated: bool, k: int) -> None:
    """Refuse a layout that cannot be cut into target groups of ``k`` ranks, naming what would."""
    if world_size == 1:
        raise DraftlineError(f"--target-parallel {k} splits each target over {k} processes; one process holds a "
                             f"whole target: launch with --gpus N (N a multiple of {k}) or drop --target-parallel")
    if colocated:
        if world_size % k:
            raise DraftlineError(f"--colocated --target-parallel {k}: every rank is one rank of a target group of {k}, "
                                 f"so the {world_size} processes must be a multiple of {k}")
        return
    if targets is None and drafters is not None:
        targets = world_size - drafters
    if targets is not None and targets % k:
        raise DraftlineError(f"{targets} target ranks cannot form target groups of --target-parallel {k}: give "
                             f"--targets a multiple of {k} (the rest of the {world_size} processes train the drafter)")
    if world_size - (targets or k) < 1:
        raise DraftlineError(f"--target-parallel {k} on {world_size} processes leaves no rank for a drafter: use more "
                             f"processes (--gpus), --colocated (a drafter beside each target rank), or a smaller "
                             "--target-parallel")


def groups_across_nodes(role: Role, ranks_per_node: int) -> list[list[int]]:
    """The target groups whose ranks are not all on one node (torchrun numbers a node's ranks consecutively, with
    ``ranks_per_node`` on each): their all-reduces would cross the network."""
    return [ranks for ranks in role.all_target_groups() if ranks[0] // ranks_per_node != ranks[-1] // ranks_per_node]


def check_groups_on_nodes(role: Role, ranks_per_node: int) -> None:
    """Refuse target groups that span two nodes (``groups_across_nodes``), naming the fix."""
    across = groups_across_nodes(role, ranks_per_node)
    if across:
        k = role.target_parallel
        raise DraftlineError(
            f"target group(s) on ranks {', '.join(f'{g[0]}-{g[-1]}' for g in across)} span two nodes of "
            f"{ranks_per_node} ranks: their all-reduces would cross the network. Keep each group on one node: "
            f"--drafters a multiple of --target-parallel {k} (the drafters are ranks 0..D-1, the targets' groups "
            f"follow), with {k} dividing the ranks per node")


def assign_roles(world_size: int, num_targets: int, num_drafters: int, colocated: bool = False,
                 target_parallel: int = 1) -> list[Role]:
    """One Role per rank (``target_parallel``: ranks per target group; ``num_targets`` counts target ranks)."""
    k = target_parallel
    if world_size == 1 or colocated:
        return [Role(i, COLOCATED, i, world_size, world_size, k) for i in range(world_size)]
    if num_targets + num_drafters != world_size:
        raise DraftlineError(f"{num_targets} targets + {num_drafters} drafters != world size {world_size}")
    roles = [Role(i, DRAFTER, i, num_targets, num_drafters, k) for i in range(num_drafters)]
    roles += [Role(num_drafters + i, TARGET, i, num_targets, num_drafters, k) for i in range(num_targets)]
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


def drafter_of(seq: int, batches_per_step: int, num_drafters: int) -> int:
    """The drafter (index) that trains batch ``seq``: the step's ``k``-th batch goes to drafter ``k % num_drafters``."""
    return (seq % batches_per_step) % num_drafters


def group_seqs(start_step: int, total_steps: int, batches_per_step: int, end_seq: int, members: list[int],
               num_drafters: int):
    """Colocated target group: every batch number its member drafters (``members``) train from ``start_step`` on,
    step by step and in order within a step, so every drafter gets its share of step ``s`` before any batch of a
    later step is computed."""
    owned = set(members)
    for step in range(start_step, total_steps):
        for seq in range(step * batches_per_step, min((step + 1) * batches_per_step, end_seq)):
            if drafter_of(seq, batches_per_step, num_drafters) in owned:
                yield seq


def drafter_seqs(start_step: int, total_steps: int, batches_per_step: int, end_seq: int, index: int,
                 num_drafters: int):
    """Every batch number drafter ``index`` trains from ``start_step`` on, in order."""
    for step in range(start_step, total_steps):
        yield from drafter_share(step, batches_per_step, end_seq, index, num_drafters)

