"""The training configuration: one typed dataclass per concern, validated up front.

A config comes from defaults, then a TOML or JSON file (``--config``), then command-line flags.
``validate`` raises ``DraftlineError`` with the field and the fix. What a config means on a rank (the
drafter's config, shapes, batches per step, the data plan) is resolved once, in ``draftline.pipeline.spec``,
and printed at start; the field docstrings below are ``--help``'s text.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftline.errors import DraftlineError


@dataclass
class ModelConfig:
    """[model] The frozen target, the drafter's shape and where its weights start."""

    target: str = ""
    """Directory of the frozen target (Hugging Face format: config.json, weights, tokenizer). Required."""
    draft_layers: int | None = None
    """Decoder layers of the drafter (the released DFlash drafters have 5; None = 5, or with init_drafter that
    drafter's). More layers draft better and cost proportionally more drafter compute and memory; fewer suit a
    small target or little data."""
    block_size: int | None = None
    """Tokens per draft block: the anchor plus block_size - 1 drafted positions (None = 16 as released, or with
    init_drafter that drafter's; the paper also trains 8 and 10). Serving drafts this many tokens per step:
    train the size you serve."""
    target_layer_ids: list[int] | None = None
    """Target layers (0-based; their outputs) whose hidden states feed the drafter, comma-separated.
    None = the z-lab rule for draft_layers features spread over the target (needs >= 5 target layers);
    set it for a shallow target or to follow a released drafter."""
    mask_token_id: int | None = None
    """Embedding row (token id) the drafter reads as the mask of positions it drafts. None = the
    target's reserved mask token (Qwen3, Qwen3.5) or else its last vocabulary row; set it to match a
    drafter you continue or serve with a given id."""
    sliding_window: int | None = None
    """Window, in tokens, of the drafter's sliding_attention layers; needed when layer_types names
    one. None = 2048 for a Qwen3.5/3.6 hybrid target's default layer types."""
    layer_types: list[str] | None = None
    """Attention of each drafter layer, comma-separated: full_attention or sliding_attention (one per
    layer). None = all full, except for Qwen3.5/3.6 hybrid targets (sliding x4 + full, as released)."""
    init_drafter: str | None = None
    """Warm start: a drafter directory (e.g. a released z-lab drafter) whose config and weights the
    run starts from, to adapt a drafter to your data instead of training one from random weights. Its shape is
    the drafter's: --draft-layers, --block-size and the like that differ from it are refused."""
    init_from_target: bool | None = None
    """Start the drafter from the target's top layers: every part whose names and shapes match (MLP, norms; an
    attention block only whole), the final norm, fc passing the deepest feature layer through. None = yes
    (unless init_drafter); False (--random-init) = random normal(0, 0.02) weights. From the target trains
    faster: +21-26% acceptance at equal compute in bench/quality.py's comparison."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16 or float32. Master weights and
    optimizer state stay float32 either way; float32 on GPU only to check numerics (slower)."""


@dataclass
class DataConfig:
    """[data] The prepared dataset, how it is packed into batches, and how long training lasts."""

    data: list[str] = field(default_factory=list)
    """The dataset directory written by `draftline prepare` (train prints the prepare command for
    anything else). Required."""
    token_budget: int = 32768
    """Tokens packed into one batch (whole documents, no padding): the unit of work of a target pass
    and a drafter step. Raise it until the GPU's memory is used (preflight says what fits); it must
    hold the longest sample. Drafter memory grows with it."""
    max_batch_size: int = 64
    """Documents per batch at most (caps a batch of many short samples); rarely needs changing."""
    max_anchors: int = 512
    """Anchors (draft blocks) sampled per document, not per batch: drafter work per token grows with
    it. Lower it when the targets wait on the drafters (q_hs full); raise it for more training signal
    per target pass when the drafters wait."""
    max_length: int | None = None
    """Used only in the `draftline prepare` command train prints when --data is not yet a prepared
    dataset: its --max-length, in tokens (default token_budget). It does not truncate prepared data."""
    sort_window: int = 1024
    """Samples per window of the batcher's length sort: it packs documents of similar length
    together within each window of this many, so batches waste few tokens. Larger packs tighter but
    orders the epoch by length over longer stretches; rarely needs changing."""
    balance_steps: bool = True
    """With several batches per optimizer step, give a step's batches similar drafter work (anchor
    counts), so drafters do not wait for each other at the all-reduce. --no-balance-steps: the plain
    shuffle (how runs started before this option ordered their batches; a resume must keep it)."""
    epochs: int = 6
    """Passes over the dataset (6 as in the DFlash paper's recipe). Fewer for a large dataset or a
    trial; more for a small one while held-out tau still rises."""
    seed: int = 0
    """Seed of the shuffle, the anchor sampling and the drafter's initial weights: the same seed and
    config give the same run."""


@dataclass
class OptimConfig:
    """[optim] AdamW, its schedule, the loss, and the batches of an optimizer step."""

    lr: float = 6e-4
    """Peak learning rate of AdamW (6e-4 as in the DFlash paper's recipe). Lower it for a warm start
    or when the loss spikes; a tiny drafter takes a higher one (the demo's 3-layer one: 3e-3)."""
    min_lr_ratio: float = 0.0
    """Where the cosine decay ends, as a fraction of lr (0..1; 0 = decays to zero)."""
    warmup_ratio: float = 0.04
    """Fraction of all optimizer steps (0..1) spent raising the learning rate linearly from 0 to lr.
    More for large lr or a large batch; 0 for a warm start that should not move at first."""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled, per step, times lr; not applied to norms). 0 as in the recipe."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's two moment decays, comma-separated (beta1,beta2). Rarely needs changing."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (all drafter parameters) to this before each update; 0 = off."""
    loss_gamma: float | None = None
    """Decay of the per-position loss weights exp(-(k-1)/gamma), in block positions. None = the
    paper's for the block size (7 for 16, 5 for 10, 4 for 8, else block_size/2); smaller weights the
    first positions more, which set most of tau."""
    loss: str = "dflash"
    """The per-position loss weights: 'dflash' (exp(-(k-1)/gamma), the paper's) or 'dpace' (D-PACE, arXiv
    2605.18810: each position's cross-entropy weighted by its detached share of the block's expected
    acceptance length, from the drafter's own probabilities; no gamma)."""
    dpace_alpha: float = 0.5
    """D-PACE's smoothing, in (0, 1]: a position's acceptance counts as (1 - alpha) q + alpha, q the drafter's
    probability of its label (0.3-0.7 train stably; 0.5 as published). Only with loss = dpace."""
    distill: float = 0.0
    """Soft labels: weight (0..1) of the target's own next-token distribution in each position's label
    (0 = the data's tokens only, the DFlash recipe; 1 = the distribution only). Above 0 the target
    runs all its layers and also sends its final hidden state (more target compute and transfer)."""
    grad_accum: int = 1
    """Batches per optimizer step per drafter rank: a step trains grad_accum x drafters batches. Raise
    it for a larger effective batch without more memory (fewer, larger steps)."""
    global_batch_tokens: int | None = None
    """Instead of grad_accum: tokens per optimizer step over all drafters (rounded up to whole batches
    of token_budget, an equal number per drafter), so the batch stays the same when the GPU count changes."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (a trial, a budget); the learning-rate schedule (warmup,
    cosine) is fitted to these steps, so the trial ends decayed like a whole run. None = all epochs."""
    max_minutes: float | None = None
    """End the training at the first step boundary after this many minutes of it (counted from this
    start's first step, a resume's too) and finish the run there: final checkpoint, exported drafter,
    final measurement. The learning-rate schedule runs on whichever ends first, the steps or the minutes
    (warmup and cosine over the share of the time spent, where that is further along than the steps),
    so a run the clock ends is annealed to the floor like a whole run; set it for a fixed time on the
    machines (a reservation, a demo). None = no time limit: the steps alone."""
    max_bad_steps: int = 20
    """Consecutive optimizer steps with a non-finite loss or gradient (each skipped, not applied)
    after which training stops with an error; raise it only to ride out a known bad stretch of data."""


@dataclass
class TopologyConfig:
    """[topology] Which ranks run the target and which train the drafter, and the queues between them."""

    targets: int | None = None
    """Ranks running the frozen target; with drafters, must add up to the world size. None = split
    from the FLOP model (`draftline plan` recommends one)."""
    drafters: int | None = None
    """Ranks training the drafter (data-parallel). None = the rest of the world size after targets."""
    colocated: bool = False
    """Every rank runs both: a target thread feeds the drafter of its own process (data-parallel
    drafters, no split). Good when targets and drafters would otherwise wait for each other."""
    drafter_state: str = "auto"
    """How several drafter ranks hold the drafter: 'shard' (FSDP2: each keeps 1/D of the weights, gradients
    and AdamW state; layers gathered for each pass), 'replicate' (each keeps all of it; one all-reduce of
    the gradients per step: for a drafter that fits on every rank, where the per-layer gathers cost more
    than they save) or 'auto' (shard on GPU, replicate on CPU, where gloo's gathers made the demo's
    colocated line 1.7-1.9x slower). Either resumes the other's checkpoints."""
    gpus: int | None = None
    """Launch this many local processes with torchrun (one per GPU; with device cpu, CPU processes),
    as `--gpus N` does. None = as launched: one process, or the ranks torchrun started (under
    torchrun it is ignored)."""
    q_pre: int = 8
    """Capacity, in batches, of each target's prefetch queue of ready token batches (built on the
    host). Raise it only if the status shows q_pre empty while targets wait on data."""
    q_hs: int = 8
    """Capacity, in batches, of the hidden-state queue over all targets: features waiting for a
    drafter. Larger smooths uneven batches at the cost of memory on the targets (one batch of
    features each); smaller when target memory is short."""
    device: str = "auto"
    """auto (CUDA if available, else CPU), cuda or cpu."""
    failure_timeout_s: float = 30.0
    """Seconds a rank may go silent before it is declared dead or hung and the run stops with its
    name. Raise it if long pauses (a slow file system, compilation) are expected."""


@dataclass
class CheckpointConfig:
    """[checkpoint] When the run saves, how many saves it keeps, and how it starts."""

    every_steps: int = 500
    """Save a checkpoint every this many optimizer steps (0 = off); a checkpoint is also written at
    the end and on a stop. Lower it when steps are slow or the machine may go away."""
    every_minutes: float = 30.0
    """Also save when this many minutes have passed since the last save (0 = off)."""
    keep: int = 3
    """Checkpoints kept in RUN_DIR/checkpoints; older ones are deleted after a new one is written.
    Each holds the drafter, optimizer and scheduler state in fp32 (about 12 bytes per parameter)."""
    resume: bool = False
    """Continue the run in the output directory from its latest checkpoint (same batches in the same
    order, none twice)."""
    from_scratch: bool = False
    """Start a new run although the output directory holds one (its files are moved aside to
    RUN_DIR/previous-TIME, not deleted)."""


@dataclass
class MonitorConfig:
    """[monitor] The status display, the logs, and the acceptance measured during training."""

    interval_s: float = 5.0
    """Seconds between status lines (or panel updates) and metrics.jsonl records."""
    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tensorboard (--no-tensorboard: none; RUN_DIR/metrics.jsonl
    is written either way)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb` and a login)."""
    wandb_project: str = "draftline"
    """The W&B project the run is logged to (with --wandb)."""
    eval_every: int | None = None
    """Measure real acceptance (speculative decoding of held-out prompts: the monitor's tau) every
    this many optimizer steps and at the end; None = about 10 times per run; 0 = only at the end."""
    eval_prompts: str | None = None
    """Prompts for that (JSONL, as `draftline eval --prompts` reads); None = the dataset's held-out
    prompts (`draftline prepare --heldout N`)."""
    eval_num_prompts: int = 8
    """Prompts used per evaluation during training (the first ones of the set): more reads tau more
    steadily and takes longer."""
    eval_max_new_tokens: int = 64
    """Tokens generated per prompt in an evaluation during training."""
    eval_final_num_prompts: int | None = None
    """Prompts of the final measurement (the monitor's last tau); None = every prompt of the set, as
    `draftline eval` without --limit. A sample of 4 prompts read 0.89x of 24 and varied by 14% (README)."""
    eval_final_max_new_tokens: int = 256
    """Tokens per prompt in the final measurement; 256 = `draftline eval`'s default --max-new-tokens."""
    peak_tflops: float | None = None
    """Peak dense matrix rate of one device, in TFLOP/s, that MFU is quoted against. None = the GPU's
    spec (known GPUs), else measured at start; set it for a GPU without a spec entry. No MFU on CPU
    unless given."""


@dataclass
class EngineConfig:
    """[engine] How the drafter's step runs: kernels, memory, compilation, checks before training."""

    attention: str = "auto"
    """Drafter attention: 'auto' (on GPU FlashAttention-4's kernels when ``flash-attn-4`` is installed
    on a Hopper or Blackwell GPU and they pass a first check against dense attention, else flex's
    Triton kernels; dense on CPU), 'flex', 'flash' (flex on FlashAttention-4's kernels, an error
    where they cannot run) or 'dense'."""
    head_chunk_rows: int = 4096
    """Rows (block positions) of vocabulary logits materialised at once by the LM head and its loss;
    their memory grows with rows x vocabulary. Lower it if the loss runs out of memory with a large vocabulary."""
    max_query_rows: int = 32768
    """Block rows (anchors x block_size) per drafter pass; a batch with more runs in several passes.
    Lower it when the drafter runs out of memory (preflight names the largest that fits)."""
    activation_checkpointing: bool = False
    """Recompute the drafter's layers in backward instead of keeping their activations: less memory,
    about 1/3 more drafter compute. Turn it on when the drafter runs out of memory at the token budget you want."""
    compile: bool = True
    """On CUDA, torch.compile the dense parts of the drafter's training step and of the target's feature
    pass (fused norms, RoPE, SwiGLU, residuals: docs/benchmarks/2026-12-drafter-step.md); ``--no-compile`` runs them eager
    (faster start, slower steps; to rule compilation out when debugging). No effect on CPU."""
    preflight: bool = True
    """On GPU, run each role's worst-case batch before training and refuse a configuration that would
    run out of memory later, naming what fits; --no-preflight skips it (faster start)."""
    memory_headroom_gib: float = 2.0
    """GiB of GPU memory that preflight keeps free (allocator fragmentation, library updates). Raise it
    if a run that passed preflight still runs out of memory."""
    gpu_memory_gib: float | None = None
    """Use at most this many GiB of each GPU (torch.cuda.set_per_process_memory_fraction): to share a GPU with
    other work, or to try a smaller GPU's sizes on a larger one; None = all of it."""
    trace: bool = False
    """Write RUN_DIR/trace/: each step's loss, and the batches and samples each drafter trained
    (audits, tests). Small files; off by default."""


@dataclass
class TrainConfig:
    """The whole training config: the run directory and one section per concern."""

    out: str = ""
    """Run directory: checkpoints, metrics.jsonl, tensorboard/, the final drafter (final/). Required;
    one live run owns it at a time."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        config = cls()
        apply_dict(config, data, source)
        return config


def _sections(config: TrainConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))}


def field_types(section_class: type) -> dict[str, Any]:
    """``{field: annotation}`` of a config section, resolved from the dataclass's annotations."""
    hints = typing.get_type_hints(section_class)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_class)}


def type_name(hint: Any) -> str:
    """How a field's type reads in a message: ``int``, ``list[int] or None``, ``tuple[float, float]``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint)).replace("NoneType", "None")
    if typing.get_origin(hint) is not None:
        return f"{typing.get_origin(hint).__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


class _WrongType(Exception):
    pass


def _check(value: Any, hint: Any) -> Any:
    """``value`` as the annotation ``hint`` wants it (a list for a tuple from JSON, 2.0 for an int
    field read as 2.0), or ``_WrongType``. No silent conversions: "6e-4" is not a float, True not an int."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg)
            except _WrongType:
                pass
        raise _WrongType
    if hint in (bool, str):  # exactly that type: 1 is not a bool, nor 6e-4 written in quotes a float
        if isinstance(value, hint):
            return value
        raise _WrongType
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 3.2e4 in TOML is a float
            return int(value)
        raise _WrongType
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _WrongType
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _WrongType
        return [_check(item, args[0]) for item in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _WrongType
        return tuple(_check(item, arg) for item, arg in zip(value, args))
    raise AssertionError(f"config field type {hint} has no check; add one to config._check")


def _nearest(name: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _field_elsewhere(name: str, sections: dict[str, Any]) -> str:
    homes = [key for key, section in sections.items() if name in field_types(type(section))]
    return f" (it is a field of [{homes[0]}]: did you mean {homes[0]}.{name}?)" if homes else ""


def set_field(config: TrainConfig, section_name: str, name: str, value: Any, source: str) -> None:
    """Set ``section.name`` after checking ``value`` against the field's annotation; the error
    names the key, the type expected and the value given."""
    section = getattr(config, section_name)
    hint = field_types(type(section))[name]
    if name == "data" and section_name == "data" and isinstance(value, str):
        value = [value]
    try:
        checked = _check(value, hint)
    except _WrongType:
        shown = f"the string {value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
        hint_text = type_name(hint)
        fix = ""
        if isinstance(value, str) and any(t in hint_text for t in ("int", "float")):
            fix = f"; write it without quotes ({name} = {value})"
        elif isinstance(value, float) and "int" in hint_text:
            fix = "; it must be a whole number"
        raise DraftlineError(f"{source}: {section_name}.{name} must be {hint_text}, got {shown}{fix}") from None
    setattr(section, name, checked)


def apply_dict(config: TrainConfig, data: dict[str, Any], source: str) -> None:
    """Set fields from a nested dict ``{section: {field: value}}`` (top-level ``out`` too), each
    checked against its dataclass annotation; unknown keys are named with the nearest valid one."""
    sections = _sections(config)
    if not isinstance(data, dict):
        raise DraftlineError(f"{source}: expected a table of sections ([model], [data], ...), got {type(data).__name__}")
    for key, value in data.items():
        if key == "out":
            if not isinstance(value, str):
                raise DraftlineError(f"{source}: out must be str, got {value!r} ({type(value).__name__})")
            config.out = value
            continue
        if key not in sections:
            raise DraftlineError(f"{source}: unknown section {key!r}{_field_elsewhere(key, sections) or _nearest(key, list(sections))}; "
                                 f"sections are {sorted(sections)} and 'out'")
        if not isinstance(value, dict):
            raise DraftlineError(f"{source}: [{key}] must be a table of fields, got {value!r}")
        names = list(field_types(type(sections[key])))
        for name, item in value.items():
            if name not in names:
                hint = _field_elsewhere(name, sections) or _nearest(name, names, f"{key}.")
                raise DraftlineError(f"{source}: unknown field {key}.{name}{hint}; fields of [{key}] are {sorted(names)}")
            set_field(config, key, name, item, source)


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise DraftlineError(f"{path}: config file not found")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise DraftlineError(f"{path}: invalid TOML ({exc})") from exc
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DraftlineError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from exc
    raise DraftlineError(f"{path}: config files are .toml or .json")


def _positive(value: Any, name: str, allow_zero: bool = False) -> None:
    bad = value is None or value < 0 or (value == 0 and not allow_zero)
    if bad:
        raise DraftlineError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def validate(config: TrainConfig) -> None:
    """Raise DraftlineError naming the field and the fix for anything that cannot run."""
    if not config.out:
        raise DraftlineError("out (--out RUN_DIR) is required: the run directory for checkpoints and metrics")
    if not config.model.target:
        raise DraftlineError("model.target (--target DIR) is required: the target model directory")
    if not config.data.data:
        raise DraftlineError("data.data (--data) is required: a prepared dataset directory or input files")
    m, d, o, t, c, e = config.model, config.data, config.optim, config.topology, config.checkpoint, config.engine
    if m.draft_layers is not None:
        _positive(m.draft_layers, "model.draft_layers (--draft-layers)")
    if m.block_size is not None and m.block_size < 2:
        raise DraftlineError(f"model.block_size (--block-size) must be >= 2, got {m.block_size}")
    if m.dtype not in ("auto", "bfloat16", "float32"):
        raise DraftlineError(f"model.dtype must be auto, bfloat16 or float32, got {m.dtype!r}")
    _positive(d.token_budget, "data.token_budget (--token-budget)")
    _positive(d.max_batch_size, "data.max_batch_size (--max-batch-size)")
    _positive(d.max_anchors, "data.max_anchors (--max-anchors)")
    _positive(d.epochs, "data.epochs (--epochs)")
    if d.max_length is not None and d.max_length > d.token_budget:
        raise DraftlineError(
            f"data.max_length={d.max_length} exceeds data.token_budget={d.token_budget}: a sample must fit in one batch; "
            "lower --max-length or raise --token-budget"
        )
    _positive(o.lr, "optim.lr (--lr)")
    if not 0 <= o.warmup_ratio < 1:
        raise DraftlineError(f"optim.warmup_ratio (--warmup-ratio) must be in [0, 1), got {o.warmup_ratio}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise DraftlineError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _positive(o.grad_accum, "optim.grad_accum (--grad-accum)")
    if o.global_batch_tokens is not None:
        _positive(o.global_batch_tokens, "optim.global_batch_tokens (--global-batch-tokens)")
        if o.grad_accum != 1:
            raise DraftlineError(
                f"optim.global_batch_tokens (--global-batch-tokens {o.global_batch_tokens}) and optim.grad_accum "
                f"(--grad-accum {o.grad_accum}) both set the batches of an optimizer step; pick one")
    if o.loss_gamma is not None:
        _positive(o.loss_gamma, "optim.loss_gamma (--loss-gamma)")
    if not 0.0 <= o.distill <= 1.0:
        raise DraftlineError(f"optim.distill (--distill) must be in [0, 1], got {o.distill}")
    if o.loss not in ("dflash", "dpace"):
        raise DraftlineError(f"optim.loss (--loss) must be dflash or dpace, got {o.loss!r}")
    if not 0.0 < o.dpace_alpha <= 1.0:
        raise DraftlineError(f"optim.dpace_alpha (--dpace-alpha) must be in (0, 1], got {o.dpace_alpha}")
    if o.loss == "dpace" and o.loss_gamma is not None:
        raise DraftlineError("optim.loss_gamma (--loss-gamma) weighs the dflash loss; --loss dpace sets its own "
                             "weights: drop --loss-gamma or use --loss dflash")
    if o.loss == "dpace" and o.distill > 0:
        raise DraftlineError("--loss dpace weighs hard labels by the drafter's probability of them; it does not "
                             "combine with --distill: drop one")
    _positive(o.grad_clip, "optim.grad_clip (--grad-clip)", allow_zero=True)
    if o.max_steps is not None:
        _positive(o.max_steps, "optim.max_steps (--max-steps)")
    if o.max_minutes is not None:
        _positive(o.max_minutes, "optim.max_minutes (--max-minutes)")
    _positive(o.max_bad_steps, "optim.max_bad_steps")
    for name in ("targets", "drafters", "gpus"):
        value = getattr(t, name)
        if value is not None:
            _positive(value, f"topology.{name} (--{name})")
    _positive(t.q_pre, "topology.q_pre (--q-pre)")
    _positive(t.q_hs, "topology.q_hs (--q-hs)")
    if t.drafter_state not in ("auto", "shard", "replicate"):
        raise DraftlineError(f"topology.drafter_state (--drafter-state) must be auto, shard or replicate, "
                             f"got {t.drafter_state!r}")
    if t.device not in ("auto", "cuda", "cpu"):
        raise DraftlineError(f"topology.device (--device) must be auto, cuda or cpu, got {t.device!r}")
    _positive(t.failure_timeout_s, "topology.failure_timeout_s")
    if m.init_drafter and m.init_from_target:
        raise DraftlineError("--init-drafter and --init-from-target both set the starting weights; pick one")
    if m.init_drafter and m.init_from_target is False:
        raise DraftlineError("--init-drafter and --random-init both set the starting weights; pick one")
    if c.resume and c.from_scratch:
        raise DraftlineError("--resume and --from-scratch contradict each other; pick one")
    _positive(c.keep, "checkpoint.keep (--keep)")
    mon = config.monitor
    _positive(mon.eval_num_prompts, "monitor.eval_num_prompts (--eval-num-prompts)")
    _positive(mon.eval_max_new_tokens, "monitor.eval_max_new_tokens (--eval-max-new-tokens)")
    if mon.eval_final_num_prompts is not None:
        _positive(mon.eval_final_num_prompts, "monitor.eval_final_num_prompts (--eval-final-num-prompts)")
    _positive(mon.eval_final_max_new_tokens, "monitor.eval_final_max_new_tokens (--eval-final-max-new-tokens)")
    if e.attention not in ("auto", "flex", "flash", "dense"):
        raise DraftlineError(f"engine.attention must be auto, flex, flash or dense, got {e.attention!r}")
    if e.max_query_rows < (m.block_size or 2):
        raise DraftlineError(f"engine.max_query_rows={e.max_query_rows} must hold at least one block ({m.block_size} rows)")
    _positive(e.head_chunk_rows, "engine.head_chunk_rows")
    if e.gpu_memory_gib is not None:
        _positive(e.gpu_memory_gib, "engine.gpu_memory_gib (--gpu-memory-gib)")
