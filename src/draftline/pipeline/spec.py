"""The run, resolved once per rank: what the builders, the loop and the monitor are handed.

``TrainConfig`` is what the user asked for; ``RunSpec`` is what it means on this rank, worked out once
and frozen: the target's and the drafter's configs, the feature layers and width, the shapes the FLOP
counter and the memory model read, how the drafter starts, this rank's role, device and dtype, and
(after rank 0's decision, ``setup``) where the run starts and the plan of its batches. Nothing
downstream reads the target's config file again or derives the drafter's config a second time.

    config ──► ModelSpec.resolve ──► roles ──► setup (rank 0: fresh or resume) ──► RunSpec
              (target + drafter                 (checkpoint's batches per step)    (+ DataPlan)
               configs, shapes)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig, Qwen3Config

from draftline.config import TrainConfig, default_q_hs, resolved_loss
from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher
from draftline.data.dataset import TokenDataset
from draftline.distributed.roles import COLOCATED, Role
from draftline.errors import DraftlineError
from draftline.model.config import (
    DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT_LAYERS, build_drafter_config, refuse_changed_drafter, refuse_shape_flags,
    text_config,
)
from draftline.objective.loss import ObjectiveSettings
from draftline.sizing.shapes import DrafterShape, TargetShape

if TYPE_CHECKING:
    from draftline.distributed.setup import RunSetup

INIT_TARGET, INIT_RANDOM, INIT_DRAFTER = "target", "random", "drafter"


@dataclass(frozen=True)
class ModelSpec:
    """The two models of a run: the frozen target and the drafter trained on its features."""

    target: str
    """The target's directory ("" when built from a config alone: benchmarks, tests)."""
    target_file_config: PretrainedConfig | None
    """The target's config as its directory holds it (a vision-language checkpoint's whole config): what
    loading its weights starts from (the target's builders copy it before they change it); None for a
    drafter benchmarked alone."""
    drafter_config: Qwen3Config
    target_shape: TargetShape | None
    drafter_shape: DrafterShape
    """With the target's final hidden state its ``teacher_layers`` are all of the target's layers; its ``method``
    what the training method adds (``method.shape``)."""
    final_hidden: bool = False
    """The target also sends its final hidden state: soft labels (``optim.distill`` > 0) or the method's own need
    (DSpark: the target's distribution)."""
    method: Any = None
    """The training method (``draftline.methods``): the drafter, objective, proposer and export it asks for."""
    init: str = INIT_RANDOM
    """How the drafter starts: from the target's layers, random, or from a released drafter."""
    init_source: str | None = None
    """The released drafter's directory (``init == "drafter"``)."""

    @property
    def target_config(self) -> PretrainedConfig | None:
        """The target's text config (the language model of a vision-language checkpoint)."""
        return text_config(self.target_file_config) if self.target_file_config is not None else None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.drafter_shape.target_layer_ids

    @property
    def block_size(self) -> int:
        return self.drafter_shape.block_size

    @property
    def hidden_size(self) -> int:
        return self.drafter_shape.hidden_size

    @property
    def feature_width(self) -> int:
        """Columns of the features a target sends: K fused layers, plus (soft labels, DSpark) the target's final
        hidden state as the last ``hidden_size`` columns."""
        return (len(self.layer_ids) + int(self.final_hidden)) * self.hidden_size

    @property
    def layers_run(self) -> int:
        """Target layers a feature pass runs (up to the deepest feature layer; all with its final hidden state)."""
        return self.drafter_shape.target_layers_run

    @property
    def num_trained_params(self) -> int:
        shape = self.drafter_shape
        return (sum(layer.token_params for layer in shape.layers) + len(self.layer_ids) * shape.hidden_size ** 2
                + shape.method.head_params)

    def describe_init(self) -> str:
        """How the drafter starts, in words (printed at the start of a run)."""
        if self.init == INIT_DRAFTER:
            return f"from the drafter in {self.init_source}"
        if self.init == INIT_TARGET:
            return "from the target's top layers (what matches the drafter's shapes; --random-init: random)"
        return "random (normal, std 0.02)"

    @classmethod
    def from_configs(cls, target_config: PretrainedConfig | None, drafter_config: Qwen3Config, *, target: str = "",
                     distill: bool = False, method=None, init: str = INIT_RANDOM,
                     init_source: str | None = None) -> "ModelSpec":
        """From the configs themselves (no files read); ``target_config`` None: a drafter benchmarked alone.
        ``method``: the training method (None: the one ``drafter_config`` was built by); ``distill``: soft labels."""
        from draftline.methods import method_for

        method = method if method is not None else method_for(drafter_config)
        final_hidden = distill or method.needs_final_hidden(ObjectiveSettings(distill=float(distill)))
        target_shape = TargetShape.of(target_config) if target_config is not None else None
        drafter_shape = dataclasses.replace(DrafterShape.of(drafter_config),
                                            method=method.shape(drafter_config, final_hidden=final_hidden))
        if final_hidden and target_shape is not None:
            drafter_shape = dataclasses.replace(drafter_shape, teacher_layers=target_shape.num_layers)
        return cls(target, target_config, drafter_config, target_shape, drafter_shape, final_hidden, method, init,
                   init_source)

    @classmethod
    def resolve(cls, config: TrainConfig) -> "ModelSpec":
        """Read the target's config (and a warm-start drafter's) once; build the drafter's config."""
        from draftline.model.target import load_target_config

        from draftline.methods import method_for, method_of

        m = config.model
        distill = config.optim.distill > 0
        released = None
        if m.init_drafter:
            from draftline.checkpoint.serving import released_drafter_config

            # A drafter for another target, or one an engine would load differently, is refused first (each
            # field named with its fix), not at export.
            released, warnings = released_drafter_config(m.init_drafter, m.target)
            for warning in warnings:
                print(f"draftline: warning: --init-drafter {m.init_drafter}: {warning}", flush=True)
        target_config = load_target_config(m.target)  # parsed once: the check above read it through the same cache
        if released is not None:
            refuse_shape_flags(m, released)
            drafter_config, init, source = released, INIT_DRAFTER, m.init_drafter
            method = method_for(released)
            if method.name == "dspark":  # the released drafter's heads, this run's loss weights
                method = type(method).of_config(released, loss=method_of(_as_dspark(config)).loss)
        else:
            from draftline.checkpoint.serving import check_drafter_config, engine_mask_token_id

            method = method_of(config)
            num_layers = m.draft_layers or DEFAULT_DRAFT_LAYERS
            base = build_drafter_config(
                target_config,
                num_hidden_layers=num_layers,
                block_size=m.block_size or DEFAULT_BLOCK_SIZE,
                # by default the row the engines will check: the target tokenizer's <|MASK|>, where it has one
                mask_token_id=m.mask_token_id if m.mask_token_id is not None else engine_mask_token_id(m.target,
                                                                                                    target_config),
                target_layer_ids=m.target_layer_ids,
                layer_types=m.layer_types if m.layer_types is not None else method.default_layer_types(num_layers),
                sliding_window=m.sliding_window,
            )
            drafter_config = method.build_config(base)  # DSpark: its heads' fields
            # The serving check's config rules, before anything is loaded: a drafter an engine would load
            # differently from how it is trained is refused now, not at export after the run.
            # A resume continues the drafter its checkpoint holds, whatever the rules say now: warned, not refused.
            for warning in check_drafter_config(drafter_config, m.target, target_config,
                                                refuse=not config.checkpoint.resume):
                print(f"draftline: warning: {warning}", flush=True)
            init, source = INIT_RANDOM if m.init_from_target is False else INIT_TARGET, None
        return cls.from_configs(target_config, drafter_config, target=m.target, distill=distill, method=method,
                                init=init, init_source=source)


def _as_dspark(config: TrainConfig) -> TrainConfig:
    """``config`` asking for DSpark (a released DSpark drafter's run: its loss weights are the run's)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, method="dspark"))


# ------------------------------------------------------------------------------------------ the data
@dataclass
class DataPlan:
    """The run's batches: the dataset, their order over all epochs, and how many make a step."""

    dataset: TokenDataset
    schedule: BatchSchedule
    batches_per_step: int
    total_steps: int
    end_seq: int
    """Batches numbered [0, end_seq) are trained in this run."""

    def batch(self, seq: int):
        epoch, _ = self.schedule.locate(seq)
        return self.dataset.packed_batch(self.schedule.sample_indices(seq), epoch, seq)


def plan_data(config: TrainConfig, data_dir: Path, batches_per_step: int) -> DataPlan:
    """The batch plan of ``data_dir`` with ``batches_per_step`` batches per optimizer step."""
    dataset = TokenDataset(data_dir)
    if len(dataset) == 0:
        raise DraftlineError(f"{data_dir}: the dataset has no samples")
    longest = int(dataset.lengths.max())
    if longest > config.data.token_budget:
        raise DraftlineError(
            f"{data_dir}: the longest sample has {longest} tokens, more than --token-budget {config.data.token_budget}; "
            f"raise --token-budget to at least {longest} or prepare the data with --max-length {config.data.token_budget}"
        )
    balanced = config.data.balance_steps and batches_per_step > 1
    anchor_positions = dataset.anchor_positions() if balanced else None
    batcher = TokenBudgetBatcher(
        dataset.lengths, config.data.token_budget, config.data.max_batch_size,
        seed=config.data.seed, sort_window=config.data.sort_window,
        step_batches=batches_per_step if config.data.balance_steps else 1, max_anchors=config.data.max_anchors,
        anchor_positions=anchor_positions,
    )
    schedule = BatchSchedule(batcher, config.data.epochs)
    total = schedule.steps(batches_per_step, config.optim.max_steps)
    return DataPlan(dataset, schedule, batches_per_step, total, min(schedule.total_batches, total * batches_per_step))


# ------------------------------------------------------------------------------------------ this rank
@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int | None = None
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE); None: all of them."""

    @classmethod
    def from_environ(cls) -> "DistEnv":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)),
                   int(local) if local else None)


def pick_device(config: TrainConfig, local_rank: int) -> torch.device:
    wanted = config.topology.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise DraftlineError("--device cuda, but this machine has no CUDA device; use --device cpu")
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise DraftlineError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); launch at most one process per GPU"
        )
    torch.cuda.set_device(local_rank)
    if config.engine.gpu_memory_gib is not None:  # the card: the device's whole use, not the allocator's alone
        from draftline.distributed.memory import cap_device

        budget = cap_device(local_rank, config.engine.gpu_memory_gib)
        print(f"draftline: rank {os.environ.get('RANK', '0')}: GPU {local_rank}: {budget.describe()}", flush=True)
    return torch.device("cuda", local_rank)


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.model.dtype)


@dataclass(frozen=True)
class RunSpec:
    """One rank's run, resolved: see the module docstring."""

    config: TrainConfig
    """The resolved config as the user gave it (saved with every checkpoint); read its knobs, not its
    model fields: ``model`` holds what they resolve to."""
    model: ModelSpec
    role: Role
    device: torch.device
    dtype: torch.dtype
    env: DistEnv = DistEnv()
    mode: str = "fresh"
    """"fresh", "resume" or "restart" (torchrun restarted the job)."""
    checkpoint: str | None = None
    """The checkpoint a resume continues from."""
    start_step: int = 0
    batches_per_step: int = 1
    """Batches per optimizer step over all drafters (a resume keeps its checkpoint's)."""
    total_steps: int = 1
    data: DataPlan | None = None
    """None for a drafter that is handed its batches (benchmarks, tests)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out)

    @property
    def colocated(self) -> bool:
        return self.role.kind == COLOCATED

    @property
    def start_seq(self) -> int:
        return self.start_step * self.batches_per_step

    @property
    def q_hs(self) -> int:
        """The hidden-state queue's capacity (``config.default_q_hs``: colocated, each rank's)."""
        return default_q_hs(self.config.topology.q_hs, self.colocated)

    @property
    def queued_feature_batches(self) -> int:
        """Feature batches a drafter holds besides the one it trains: colocated, the hidden-state queue;
        else its receive prefetch (``transport.RECEIVE_PREFETCH``) and the one in flight."""
        from draftline.pipeline.transport import RECEIVE_PREFETCH

        return self.q_hs if self.colocated else RECEIVE_PREFETCH + 1

    def drafter_seqs(self, step: int) -> list[int]:
        """The batch numbers of ``step`` this drafter trains (its share; possibly none)."""
        from draftline.distributed.roles import drafter_share

        end = self.data.end_seq if self.data is not None else (step + 1) * self.batches_per_step
        return drafter_share(step, self.batches_per_step, end, self.role.index, self.role.num_drafters)

    @classmethod
    def standalone(cls, config: TrainConfig, model: ModelSpec, device: torch.device, *, dtype: torch.dtype | None = None,
                   total_steps: int = 10**6, batches_per_step: int = 1) -> "RunSpec":
        """A single drafter that is handed its batches (benchmarks, tests): no data plan, no run directory."""
        role = Role(0, COLOCATED, 0, 1, 1)
        return cls(config, model, role, device, dtype or compute_dtype(config, device),
                   batches_per_step=batches_per_step, total_steps=total_steps)


def default_batches_per_step(config: TrainConfig, num_drafters: int) -> int:
    """Batches per optimizer step of a fresh start, over all drafters: ``grad_accum`` per drafter, or enough
    for ``global_batch_tokens`` rounded up to a multiple of the drafters. Always a multiple, so every drafter
    has an equal share of every step; a resume keeps its checkpoint's."""
    if config.optim.global_batch_tokens:
        batches = max(1, math.ceil(config.optim.global_batch_tokens / config.data.token_budget))
        return -(-batches // num_drafters) * num_drafters
    return config.optim.grad_accum * num_drafters


def resumed_batches_per_step(checkpoint: str, saved: int | None, balance_saved: bool | None, fresh: int,
                             balance_now: bool, num_drafters: int, checkpoint_drafters: int | None) -> tuple[int, str | None]:
    """The batches per optimizer step a resume keeps (the checkpoint's), and a line saying so when the number
    of drafters changed; refuses a checkpoint whose batch order the config would not continue."""
    per_step = saved or fresh
    balanced_then = bool(balance_saved)  # absent: written before data.balance_steps (the plain order)
    if per_step > 1 and balanced_then != balance_now:
        then = "balanced steps" if balanced_then else "the plain order" + ("" if balance_saved is not None else
                                                                            " (written before data.balance_steps)")
        fix = "without --no-balance-steps" if balanced_then else "with --no-balance-steps"
        raise DraftlineError(
            f"{checkpoint}: its run ordered the batches with {then}, this run would use "
            f"{'balanced steps' if balance_now else 'the plain order'}: resume {fix} so the data continues "
            "where it stopped")
    note = None
    if checkpoint_drafters is not None and checkpoint_drafters != num_drafters:
        note = (f"written by {checkpoint_drafters} drafter(s), resumed on {num_drafters}: a step keeps its "
                f"{per_step} batch(es), {per_step / num_drafters:g} per drafter")
    elif per_step != fresh:
        note = (f"the checkpoint's optimizer step has {per_step} batch(es) (this config alone would give {fresh}): "
                "kept, so the data continues where it stopped")
    return per_step, note


def refuse_changed_moments(checkpoint: str, saved: str | None, now: str) -> None:
    """A resume keeps the AdamW moments' dtype its checkpoint was saved with (absent: written before
    optim.moments, fp32): another would not continue the same optimizer."""
    saved = saved or "fp32"
    if saved != now:
        raise DraftlineError(
            f"{checkpoint}: its AdamW moments are {saved} (optim.moments), this run asks for {now}: resume with "
            f"--moments {saved}, or start a new run (--from-scratch) to train with {now} moments")


def refuse_changed_loss(checkpoint: str, saved: str | None, now: str) -> None:
    """A resume keeps the loss weights its checkpoint trained with (``config.resolved_loss``; None: not known, not
    compared): the other weights would train another objective from the middle of the schedule."""
    if saved is not None and saved != now:
        raise DraftlineError(
            f"{checkpoint}: its run trained with the {saved} loss weights (optim.loss), this run asks for {now}: "
            f"resume with --loss {saved}, or start a new run (--from-scratch, or another --out) to train with {now}")


def resolve_run(config: TrainConfig, model: ModelSpec, role: Role, env: DistEnv, device, setup: RunSetup
                ) -> tuple[RunSpec, str | None]:
    """This rank's ``RunSpec`` once rank 0 decided the start; and, on a resume, a line about what it keeps."""
    if config.engine.max_query_rows < model.block_size:
        raise DraftlineError(f"engine.max_query_rows={config.engine.max_query_rows} must hold at least one block "
                             f"({model.block_size} rows)")
    dtype = compute_dtype(config, device)
    fresh = default_batches_per_step(config, role.num_drafters)
    per_step, note = fresh, None
    if setup.checkpoint:
        refuse_changed_drafter(setup.checkpoint, model.drafter_config)
        refuse_changed_moments(setup.checkpoint, setup.moments, config.optim.moments)
        refuse_changed_loss(setup.checkpoint, setup.loss, resolved_loss(config))
        per_step, note = resumed_batches_per_step(setup.checkpoint, setup.batches_per_step, setup.balance_steps, fresh,
                                                  config.data.balance_steps, role.num_drafters,
                                                  setup.checkpoint_drafters)
    data = plan_data(config, Path(setup.data_dir), per_step)
    spec = RunSpec(config, model, role, device, dtype, env, setup.mode, setup.checkpoint,
                   setup.start_step, per_step, data.total_steps, data)
    return spec, note
