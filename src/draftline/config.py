"""The training configuration: one typed dataclass per concern, validated up front.

A config comes from defaults, then a TOML or JSON file (``--config``), then command-line flags.
``validate`` raises ``DraftlineError`` with the field and the fix; derived quantities are computed by
functions in ``draftline.pipeline.plan`` and printed once at start.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftline.errors import DraftlineError


@dataclass
class ModelConfig:
    target: str = ""
    """Hugging Face model directory of the frozen target."""
    draft_layers: int | None = None
    """Decoder layers in the drafter; None = 5 (or, with init_drafter, that drafter's)."""
    block_size: int | None = None
    """Tokens per block: the anchor plus block_size - 1 draft slots; None = 16 (or, with init_drafter, that drafter's)."""
    target_layer_ids: list[int] | None = None
    """Target layers whose outputs feed the drafter; None = the z-lab rule for draft_layers."""
    mask_token_id: int | None = None
    """Embedding row used as the mask token; None = the target's reserved mask (Qwen3) or last row."""
    sliding_window: int | None = None
    """Window of sliding_attention layers (with layer_types)."""
    layer_types: list[str] | None = None
    """Per drafter layer: 'full_attention' (default) or 'sliding_attention'."""
    init_drafter: str | None = None
    """Warm start: a drafter directory (e.g. a released z-lab drafter) to start from."""
    init_from_target: bool | None = None
    """Start the drafter from the target's top layers: every tensor whose name and shape match (MLP, norms;
    an attention block only whole), the final norm, fc passing the deepest feature layer through.
    None = yes (unless init_drafter); False (--random-init) = random normal(0, 0.02) weights."""
    dtype: str = "auto"
    """Compute dtype: 'auto' (bf16 on GPU, fp32 on CPU), 'bfloat16' or 'float32'. Master weights stay fp32."""


@dataclass
class DataConfig:
    data: list[str] = field(default_factory=list)
    """A prepared dataset directory, or input files that `prepare` accepts (prepared into the run dir)."""
    token_budget: int = 32768
    """Tokens packed into one batch (whole documents, no padding)."""
    max_batch_size: int = 64
    """Documents per batch at most."""
    max_anchors: int = 512
    """Anchors sampled per document (not per batch)."""
    max_length: int | None = None
    """When --data needs preparing: truncate longer conversations to this many tokens (default: token_budget)."""
    sort_window: int = 1024
    """The batcher orders samples by length within windows of this many, so packing wastes little."""
    balance_steps: bool = True
    """With several batches per optimizer step, give a step's batches similar drafter work (anchor
    counts), so drafters do not wait for each other at the all-reduce; off: the plain shuffle (how
    runs started before this option ordered their batches)."""
    epochs: int = 6
    """Passes over the data."""
    seed: int = 0
    """Seeds shuffling, anchor sampling and the drafter's initialisation."""


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """Cosine decays to lr * min_lr_ratio."""
    warmup_ratio: float = 0.04
    """Share of the total steps spent warming up linearly."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    loss_gamma: float | None = None
    """Decay of the per-position loss weights exp(-(k-1)/gamma); None = the paper's for the block size."""
    distill: float = 0.0
    """Soft labels: weight of the target's own next-token distribution in each position's label
    (0 = the data's tokens only, the DFlash recipe; 1 = the distribution only). Above 0 the target
    runs all its layers and also sends its final hidden state."""
    grad_accum: int = 1
    """Batches per optimizer step per drafter rank (a step trains grad_accum x drafters batches)."""
    global_batch_tokens: int | None = None
    """Alternative to grad_accum: tokens per optimizer step over all drafters (rounded up to whole
    batches, an equal number per drafter)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (trials); the schedule still spans the whole run."""
    max_bad_steps: int = 20
    """Consecutive steps with a non-finite loss or gradient (skipped) before training stops."""


@dataclass
class TopologyConfig:
    targets: int | None = None
    """Ranks running the target; with drafters, must add up to the world size. None = planned."""
    drafters: int | None = None
    """Ranks training the drafter."""
    colocated: bool = False
    """Every rank runs a target thread and a drafter (data-parallel drafters, no split)."""
    gpus: int | None = None
    """Launch this many local processes with torchrun (one per GPU); None = as launched."""
    q_pre: int = 8
    """Prefetch queue of ready token batches per target."""
    q_hs: int = 8
    """Hidden-state queue capacity (batches of features waiting for a drafter), over all targets."""
    device: str = "auto"
    """'auto' (CUDA if available), 'cuda' or 'cpu'."""
    failure_timeout_s: float = 30.0
    """A rank silent for this long is declared dead or hung and the run stops."""


@dataclass
class CheckpointConfig:
    every_steps: int = 500
    """Save every this many optimizer steps (0 = off)."""
    every_minutes: float = 30.0
    """... and at least this often (0 = off)."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted after a new one is written."""
    resume: bool = False
    """Continue the run in the output directory from its latest checkpoint."""
    from_scratch: bool = False
    """Start over although the output directory has checkpoints (they are moved aside)."""


@dataclass
class MonitorConfig:
    interval_s: float = 5.0
    """Seconds between status blocks."""
    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "draftline"
    """W&B project name."""
    eval_every: int | None = None
    """Measure real acceptance (speculative decoding of held-out prompts: the monitor's tau) every
    this many steps and at the end; None = about 10 times per run; 0 = only at the end."""
    eval_prompts: str | None = None
    """Prompts for that (JSONL); default: the dataset's held-out prompts."""
    eval_num_prompts: int = 8
    """Prompts used per evaluation during training (the first ones of the set)."""
    eval_max_new_tokens: int = 64
    """Tokens generated per prompt in an evaluation during training."""
    eval_final_num_prompts: int | None = None
    """Prompts of the final measurement (the monitor's last tau); None = every prompt of the set, as
    `draftline eval` without --limit. A sample of 4 prompts read 0.89x of 24 and varied by 14% (README)."""
    eval_final_max_new_tokens: int = 256
    """Tokens per prompt in the final measurement; 256 = `draftline eval`'s default --max-new-tokens."""
    peak_tflops: float | None = None
    """Peak dense matrix rate per device for MFU; None = known table, else measured at start."""


@dataclass
class EngineConfig:
    attention: str = "auto"
    """Drafter attention: 'auto' (on GPU FlashAttention-4's kernels when ``flash-attn-4`` is installed
    on a Hopper or Blackwell GPU and they pass a first check against dense attention, else flex's
    Triton kernels; dense on CPU), 'flex', 'flash' (flex on FlashAttention-4's kernels, an error
    where they cannot run) or 'dense'."""
    head_chunk_rows: int = 4096
    """Rows of vocabulary logits materialised at once."""
    max_query_rows: int = 32768
    """Block rows (anchors x block) per drafter pass; a larger batch runs in several passes."""
    activation_checkpointing: bool = False
    """Recompute drafter layers in backward (less memory, ~1/3 more drafter compute)."""
    compile: bool = True
    """On CUDA, torch.compile the dense parts of the drafter's training step and of the target's feature
    pass (fused norms, RoPE, SwiGLU, residuals: docs/PERF_NOTES.md); ``--no-compile`` runs them eager."""
    preflight: bool = True
    """Run each role's worst-case batch before training and refuse a configuration that would run out of memory."""
    memory_headroom_gib: float = 2.0
    """GPU memory kept free by preflight (allocator fragmentation, library updates)."""
    gpu_memory_gib: float | None = None
    """Use at most this many GiB of each GPU (torch.cuda.set_per_process_memory_fraction): to share a GPU with
    other work, or to try a smaller GPU's sizes on a larger one; None = all of it."""
    trace: bool = False
    """Write RUN_DIR/trace/: each step's loss, and the batches and samples each drafter trained (audits, tests)."""


@dataclass
class TrainConfig:
    out: str = ""
    """Run directory: checkpoints, metrics, final drafter."""
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
    if o.loss_gamma is not None:
        _positive(o.loss_gamma, "optim.loss_gamma (--loss-gamma)")
    if not 0.0 <= o.distill <= 1.0:
        raise DraftlineError(f"optim.distill (--distill) must be in [0, 1], got {o.distill}")
    _positive(o.grad_clip, "optim.grad_clip (--grad-clip)", allow_zero=True)
    if o.max_steps is not None:
        _positive(o.max_steps, "optim.max_steps (--max-steps)")
    _positive(o.max_bad_steps, "optim.max_bad_steps")
    for name in ("targets", "drafters", "gpus"):
        value = getattr(t, name)
        if value is not None:
            _positive(value, f"topology.{name} (--{name})")
    _positive(t.q_pre, "topology.q_pre (--q-pre)")
    _positive(t.q_hs, "topology.q_hs (--q-hs)")
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


def grad_accum_batches(config: TrainConfig, num_drafters: int = 1) -> int:
    """Batches per optimizer step, over all drafters: ``grad_accum`` per drafter, or enough for
    ``global_batch_tokens`` rounded up to a multiple of the drafters. Always a multiple, so the
    round robin of batch numbers gives every drafter an equal share of every step."""
    if config.optim.global_batch_tokens:
        batches = max(1, math.ceil(config.optim.global_batch_tokens / config.data.token_budget))
        return -(-batches // num_drafters) * num_drafters
    return config.optim.grad_accum * num_drafters
