"""Building a rank's pieces from its ``RunSpec``: the target, the drafter and their workers. No training here.

The one place a target worker or a drafter worker is put together: the line, ``draftline plan
--measure``, the benchmarks (bench/) and the tests all call ``build_target_worker`` and
``build_drafter_worker``. What is applied to the drafter from outside its model file happens here,
in this order: the starting weights (``spec.model.init``), activation checkpointing, compilation
(CUDA), sharding over the drafters (``shard.DrafterGroup``), the health watch on its layers.
"""

from __future__ import annotations

import torch

from draftline.config import EngineConfig, resolved_loss
from draftline.distributed.health import Health
from draftline.distributed.roles import drafter_seqs, group_seqs
from draftline.distributed.shard import DrafterGroup
from draftline.distributed.target_group import TargetGroup
from draftline.errors import DraftlineError
from draftline.evaluate.during_training import InTrainingEvaluation
from draftline.model.drafter import DFlashDrafter, checkpoint_layers
from draftline.model.target import TargetFeatures, load_embedding_and_head
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.pipeline.drafter_worker import DrafterWorker
from draftline.pipeline.optim import build_optimizer, build_scheduler
from draftline.pipeline.progress import Progress
from draftline.pipeline.spec import INIT_DRAFTER, INIT_TARGET, RunSpec
from draftline.pipeline.target_worker import Prefetcher, TargetWorker


# ------------------------------------------------------------------------------------------ target
def build_target(spec: RunSpec, group: TargetGroup | None = None) -> TargetFeatures:
    """The frozen target that computes the drafter's features on this rank (compiled on CUDA); ``group``: this rank's
    target group, whose ranks split the target among them (None: the whole target here)."""
    # The same copy decodes for evaluation (colocated, one rank per target: a split target does not evaluate).
    keep_all = spec.colocated and spec.role.is_logging and group is None
    target = TargetFeatures(spec.model.target, list(spec.model.layer_ids), device=spec.device, dtype=spec.dtype,
                            keep_all_layers=keep_all, final_hidden=spec.model.final_hidden,
                            config=spec.model.target_file_config,
                            group=group.device_group if group is not None else None,
                            fp8=spec.config.model.target_fp8)
    # A split target runs eager: its layers' forwards hold transformers' tensor-parallel hooks and all-reduces, which
    # compile_target's whole-layer compilation has not been checked against on GPUs.
    if spec.config.engine.compile and spec.device.type == "cuda" and group is None:
        from draftline.model.fused import compile_target

        compile_target(target)  # fused norms, RoPE, SwiGLU and residuals around the matmuls
    return target


def target_seqs(spec: RunSpec):
    """The batch numbers this rank's target computes, in order: colocated, exactly the ones its own drafter
    trains (in a target group, those of the group's drafters: every rank of a group computes the same ones); else
    every ``num_target_groups``-th (one rank per target: every ``num_targets``-th)."""
    plan, role = spec.data, spec.role
    if spec.colocated and role.target_parallel > 1:
        return group_seqs(spec.start_step, spec.total_steps, spec.batches_per_step, plan.end_seq,
                          role.group_ranks(role.target_group), role.num_drafters)
    if spec.colocated:
        return drafter_seqs(spec.start_step, spec.total_steps, spec.batches_per_step, plan.end_seq, role.index,
                            role.num_drafters)
    return (b.seq for b in plan.schedule.batches(spec.start_seq, role.target_group, role.num_target_groups)
            if b.seq < plan.end_seq)


def build_target_worker(spec: RunSpec, target: TargetFeatures, sender, health: Health, *, on_batch=None,
                        group: TargetGroup | None = None) -> TargetWorker:
    """The target role's loop: prefetch this rank's batches, run the target, hand the features to ``sender``
    (``group``: this rank's target group, whose ranks agree on each batch before its forward)."""
    prefetcher = Prefetcher(target_seqs(spec), spec.data.batch, spec.config.topology.q_pre, health)
    return TargetWorker(features=target, prefetcher=prefetcher, sender=sender, health=health,
                        shape=spec.model.target_shape, layers_run=target.layers_run, on_batch=on_batch,
                        device=spec.device, group=group)


# ------------------------------------------------------------------------------------------ evaluation
SPLIT_TARGET_EVALUATION = (
    "not measured during training: the target is split over target groups (--target-parallel), so no rank holds a "
    "copy that can decode beside the drafter; measure the exported drafter with `draftline eval` where one GPU holds "
    "the target, or in a serving engine that runs it tensor-parallel (the drafter's model card has the commands)")


def build_evaluation(spec: RunSpec, group: DrafterGroup, logger, *, target_worker=None) -> InTrainingEvaluation:
    """The measurements of acceptance during training (``target_worker``: colocated, the thread whose target
    copy decodes; none with a split target)."""
    split = spec.role.target_parallel > 1
    return InTrainingEvaluation(spec.config.monitor, total_steps=spec.total_steps,
                                drafter_config=spec.model.drafter_config, method=spec.model.method,
                                target=spec.model.target,
                                dataset=spec.data.dataset if spec.data is not None else None, device=spec.device,
                                dtype=spec.dtype, group=group, logger=logger,
                                target_worker=None if split else target_worker,
                                unavailable=SPLIT_TARGET_EVALUATION if split else None)


# ------------------------------------------------------------------------------------------ drafter
def build_drafter(spec: RunSpec) -> DFlashDrafter:
    """fp32 master weights on ``spec.device``: random (seeded), from the target's layers, or a released drafter's."""
    model = spec.model
    if model.init == INIT_DRAFTER:
        from draftline.checkpoint.export import load_drafter

        return load_drafter(model.init_source, device=spec.device, dtype=torch.float32, config=model.drafter_config)
    torch.manual_seed(spec.config.data.seed)
    drafter = model.method.build_drafter(model.drafter_config).float()
    if model.init == INIT_TARGET:
        from draftline.model.warm_start import init_from_target

        init_from_target(drafter, model.target, model.target_file_config)
    return drafter.to(device=spec.device)


def build_objective(spec: RunSpec, drafter: DFlashDrafter, embed: torch.Tensor, head: torch.Tensor) -> DFlashObjective:
    """The method's objective of ``drafter`` with the target's frozen embedding and LM head."""
    c = spec.config
    settings = ObjectiveSettings(max_anchors=c.data.max_anchors, head_chunk_rows=c.engine.head_chunk_rows,
                                 attention=c.engine.attention, seed=c.data.seed, gamma=c.optim.loss_gamma,
                                 distill=c.optim.distill, loss=resolved_loss(c), dpace_alpha=c.optim.dpace_alpha)
    return spec.model.method.objective(drafter, embed, head, settings)


def target_embedding_and_head(spec: RunSpec, target: TargetFeatures | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen embedding and LM head: the rank's own target's (colocated: not held twice), else read
    from the target's checkpoint."""
    if target is not None:
        return target.embed_weight(), target.head_weight()
    if not spec.model.target:
        raise DraftlineError("a drafter built from a config alone needs the embedding and head passed in")
    return load_embedding_and_head(spec.model.target, device=spec.device, dtype=spec.dtype,
                                   config=spec.model.target_file_config)


def apply_engine(drafter: DFlashDrafter, engine: EngineConfig, compiles: bool) -> DFlashDrafter:
    """What ``engine`` applies to the drafter from outside its model file, in place: whole layers recomputed
    (``activation_checkpointing``), then (``compiles``: CUDA) the compiled halves keeping what ``recompute``
    says (fused norms/RoPE/SwiGLU, fewer saved activations)."""
    if engine.activation_checkpointing:
        checkpoint_layers(drafter)
    if compiles:
        from draftline.model.fused import compile_drafter

        compile_drafter(drafter, recompute=engine.recompute)
    return drafter


def build_drafter_worker(spec: RunSpec, health: Health, *, group: DrafterGroup | None = None,
                         target: TargetFeatures | None = None, embed: torch.Tensor | None = None,
                         head: torch.Tensor | None = None, compile_layers: bool | None = None,
                         on_batch=None) -> DrafterWorker:
    """The drafter role's worker: drafter, objective, optimizer and schedule, with what is applied from
    outside (activation checkpointing, compilation, sharding, the health watch). ``embed``/``head``: the
    target's frozen weights (default: from ``target``, else read from the target's directory)."""
    c = spec.config
    group = group or DrafterGroup(health=health)
    drafter = build_drafter(spec)
    compiles = (c.engine.compile if compile_layers is None else compile_layers) and spec.device.type == "cuda"
    apply_engine(drafter, c.engine, compiles)
    group.shard(drafter, spec.device, spec.dtype)
    health.watch(drafter.layers)
    if embed is None or head is None:
        embed, head = target_embedding_and_head(spec, target)
    objective = build_objective(spec, drafter, embed, head)
    optimizer = build_optimizer(drafter, c.optim)
    progress = Progress(spec.start_step, spec.batches_per_step)
    scheduler = build_scheduler(optimizer, c.optim, spec.total_steps, progress)
    return DrafterWorker(
        objective=objective, optimizer=optimizer, scheduler=scheduler, group=group, health=health,
        device=spec.device, compute_dtype=spec.dtype, progress=progress, total_steps=spec.total_steps,
        max_query_rows=c.engine.max_query_rows, grad_clip=c.optim.grad_clip, max_bad_steps=c.optim.max_bad_steps,
        shape=spec.model.drafter_shape,
        activation_checkpointing=c.engine.activation_checkpointing, on_batch=on_batch,
    )
