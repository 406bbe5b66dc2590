"""Building a rank's pieces: device, data, target, drafter, optimizer. No training happens here."""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from draftline.checkpoint.export import load_drafter, load_drafter_config
from draftline.checkpoint.state import load_checkpoint
from draftline.config import TrainConfig, grad_accum_batches
from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher
from draftline.data.dataset import META_FILE, TokenDataset
from draftline.errors import DraftlineError
from draftline.model.config import build_drafter_config, check_matches_target
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config
from draftline.objective.loss import DFlashObjective, ObjectiveSettings
from draftline.pipeline.roles import COLOCATED, Role


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> "DistEnv":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


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
    return torch.device("cuda", local_rank)


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.model.dtype)


@dataclass
class DataPlan:
    dataset: TokenDataset
    schedule: BatchSchedule
    batches_per_step: int
    total_steps: int
    end_seq: int  # batches numbered [0, end_seq) are trained in this run

    def batch(self, seq: int):
        epoch, _ = self.schedule.locate(seq)
        return self.dataset.packed_batch(self.schedule.sample_indices(seq), epoch, seq)


def steps_for(total_batches: int, batches_per_step: int, max_steps: int | None) -> int:
    """Optimizer steps of a run: every batch once (the last step may be short), or ``max_steps``."""
    steps = math.ceil(total_batches / batches_per_step)
    return min(steps, max_steps) if max_steps else steps


def plan_data(config: TrainConfig, data_dir: Path, num_drafters: int = 1) -> DataPlan:
    dataset = TokenDataset(data_dir)
    if len(dataset) == 0:
        raise DraftlineError(f"{data_dir}: the dataset has no samples")
    longest = int(dataset.lengths.max())
    if longest > config.data.token_budget:
        raise DraftlineError(
            f"{data_dir}: the longest sample has {longest} tokens, more than --token-budget {config.data.token_budget}; "
            f"raise --token-budget to at least {longest} or prepare the data with --max-length {config.data.token_budget}"
        )
    per_step = grad_accum_batches(config, num_drafters)
    batcher = TokenBudgetBatcher(
        dataset.lengths, config.data.token_budget, config.data.max_batch_size,
        seed=config.data.seed, sort_window=config.data.sort_window,
        step_batches=per_step if config.data.balance_steps else 1, max_anchors=config.data.max_anchors,
        anchor_positions=dataset.anchor_positions() if config.data.balance_steps and per_step > 1 else None,
    )
    schedule = BatchSchedule(batcher, config.data.epochs)
    total = steps_for(schedule.total_batches, per_step, config.optim.max_steps)
    return DataPlan(dataset, schedule, per_step, total, min(schedule.total_batches, total * per_step))


def drafter_config(config: TrainConfig):
    """The drafter's config: from the warm-start drafter, else derived from the target's."""
    target_config = load_target_config(config.model.target)
    if config.model.init_drafter:
        drafter_cfg = load_drafter_config(config.model.init_drafter)
        check_matches_target(drafter_cfg, target_config)
        return drafter_cfg
    return build_drafter_config(
        target_config,
        num_hidden_layers=config.model.draft_layers,
        block_size=config.model.block_size,
        mask_token_id=config.model.mask_token_id,
        target_layer_ids=config.model.target_layer_ids,
        layer_types=config.model.layer_types,
        sliding_window=config.model.sliding_window,
    )


def build_drafter(config: TrainConfig, device: torch.device) -> DFlashDrafter:
    """fp32 master weights on ``device``: a fresh seeded init or the warm-start weights."""
    if config.model.init_drafter:
        return load_drafter(config.model.init_drafter, device=device, dtype=torch.float32)
    torch.manual_seed(config.data.seed)
    drafter = DFlashDrafter(drafter_config(config)).float()
    if config.model.init_from_target:
        from draftline.model.warm_start import init_from_target

        init_from_target(drafter, config.model.target)
    return drafter.to(device=device)


def resolve_data_dir(config: TrainConfig) -> Path:
    """The prepared dataset to train on: ``--data`` itself.

    Preparing is its own step (``draftline prepare``), before the line starts: no rank of a
    training run tokenizes. Anything else is refused with the exact command that prepares it.
    """
    sources = [Path(p) for p in config.data.data]
    if len(sources) == 1 and (sources[0] / META_FILE).is_file():
        return sources[0]
    out = Path(config.out) / "data"
    command = shlex.join([
        "draftline", "prepare", "--target", str(config.model.target), "--input", *map(str, sources), "--out", str(out),
        "--max-length", str(config.data.max_length or config.data.token_budget),
        "--heldout", str(config.monitor.eval_num_prompts), "--seed", str(config.data.seed),
    ])
    what = "is not a prepared dataset (no meta.json)" if len(sources) == 1 else "are not one prepared dataset"
    raise DraftlineError(f"--data {' '.join(map(str, sources))} {what}; prepare it first, then train with "
                         f"--data {out}:\n  {command}")


def build_target(config: TrainConfig, role: Role, device: torch.device, dtype: torch.dtype) -> TargetFeatures:
    """The frozen target that computes the drafter's features on this rank."""
    layer_ids = drafter_config(config).dflash_config["target_layer_ids"]
    keep_all = role.kind == COLOCATED and role.is_logging  # the same copy decodes for evaluation
    target = TargetFeatures(config.model.target, layer_ids, device=device, dtype=dtype,
                            keep_all_layers=keep_all, final_hidden=config.optim.distill > 0)
    if config.engine.compile and device.type == "cuda":
        from draftline.model.fused import compile_target

        compile_target(target)  # fused norms, RoPE, SwiGLU and residuals around the matmuls
    return target


def feature_width(config: TrainConfig, drafter: DFlashDrafter) -> int:
    """Columns of the features a target sends: K fused layers, plus with soft labels the target's
    final hidden state as the last ``hidden_size`` columns."""
    teacher = 1 if config.optim.distill > 0 else 0
    return (len(drafter.target_layer_ids) + teacher) * drafter.config.hidden_size


def build_objective(config: TrainConfig, drafter: DFlashDrafter, device: torch.device, dtype: torch.dtype,
                    target: TargetFeatures | None = None) -> DFlashObjective:
    """The DFlash objective of ``drafter`` with the target's frozen embedding and LM head (taken from
    ``target`` when this rank runs it, else loaded from the checkpoint)."""
    if target is not None:
        embed, head = target.embed_weight(), target.head_weight()
    else:
        embed, head = load_embedding_and_head(config.model.target, device=device, dtype=dtype)
    settings = ObjectiveSettings(max_anchors=config.data.max_anchors, head_chunk_rows=config.engine.head_chunk_rows,
                                 attention=config.engine.attention, seed=config.data.seed, gamma=config.optim.loss_gamma,
                                 distill=config.optim.distill)
    return DFlashObjective(drafter, embed, head, settings)


def resume_training(checkpoint: str, *, drafter, optimizer, scheduler, batches_per_step: int,
                    num_drafters: int, balance_steps: bool = True) -> int:
    """Load ``checkpoint`` into the drafter, optimizer and schedule; the step to continue from.

    Refuses a checkpoint trained with another number of batches per optimizer step, or with the
    other batch order (``data.balance_steps``; a checkpoint from before that option had the plain
    order): the data would not continue where it stopped."""
    state = load_checkpoint(checkpoint, drafter=drafter, optimizer=optimizer, scheduler=scheduler)
    if state.step and state.next_seq != state.step * batches_per_step:
        raise DraftlineError(
            f"{checkpoint}: trained with {state.next_seq // state.step} batches per optimizer step, "
            f"this run has {batches_per_step} (--grad-accum per drafter x {num_drafters} drafter(s)): "
            "resume with the checkpoint's --grad-accum and number of drafters so the data continues where it stopped"
        )
    saved = state.config.get("data", {})
    balanced_then = bool(saved.get("balance_steps", False))  # absent: written before the option (plain order)
    if batches_per_step > 1 and balanced_then != balance_steps:
        then = "balanced steps" if balanced_then else "the plain order" + ("" if "balance_steps" in saved else
                                                                            " (written before data.balance_steps)")
        fix = "without --no-balance-steps" if balanced_then else "with --no-balance-steps"
        raise DraftlineError(
            f"{checkpoint}: its run ordered the batches with {then}, this run would use "
            f"{'balanced steps' if balance_steps else 'the plain order'}: resume {fix} so the data continues "
            "where it stopped"
        )
    return state.step
