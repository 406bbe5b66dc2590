"""The training configuration: one typed dataclass per concern, validated up front.

A config comes from defaults, then a TOML or JSON file (``--config``: ``draftline.config_io``), then
command-line flags (``draftline.config_flags``). Each field is declared once, with ``opt``
(``draftline.config_options``): its default, its flag, its metavar and the values it takes; the docstring
under it is its ``--help`` text. ``validate`` raises ``DraftlineError`` with the field and the fix. What a
config means on a rank (the drafter's config, shapes, batches per step, the data plan) is resolved once,
in ``draftline.pipeline.spec``, and printed at start.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from draftline.config_io import apply_dict, field_types
from draftline.config_options import FRACTION, NON_NEGATIVE, POSITIVE, OneOf, Option, Within, opt, option
from draftline.errors import DraftlineError


@dataclass
class ModelConfig:
    """[model] The frozen target, the drafter's shape and where its weights start."""

    target: str = opt("", "--target", metavar="DIR")
    """Directory of the frozen target (Hugging Face format: config.json, weights, tokenizer). Required."""
    draft_layers: int | None = opt(None, "--draft-layers", metavar="LAYERS", check=POSITIVE)
    """Decoder layers of the drafter (the released DFlash drafters have 5; None = 5, or with init_drafter that
    drafter's). More layers draft better and cost proportionally more drafter compute and memory; fewer suit a
    small target or little data."""
    block_size: int | None = opt(None, "--block-size", metavar="TOKENS", check=Within(2))
    """Tokens per draft block: the anchor plus block_size - 1 drafted positions (None = 16 as released, or with
    init_drafter that drafter's; the paper also trains 8 and 10). Serving drafts this many tokens per step:
    train the size you serve."""
    target_layer_ids: list[int] | None = opt(None, "--target-layer-ids", metavar="ID,ID,...")
    """Target layers (0-based; their outputs) whose hidden states feed the drafter, comma-separated.
    None = the z-lab rule for draft_layers features spread over the target (needs >= 5 target layers);
    set it for a shallow target or to follow a released drafter."""
    mask_token_id: int | None = opt(None, "--mask-token-id", metavar="TOKEN_ID")
    """Embedding row (token id) the drafter reads as the mask of positions it drafts. None = the
    target's reserved mask token (Qwen3, Qwen3.5) or else its last vocabulary row; set it to match a
    drafter you continue or serve with a given id."""
    sliding_window: int | None = opt(None, "--sliding-window", metavar="TOKENS")
    """Window, in tokens, of the drafter's sliding_attention layers; needed when layer_types names
    one. None = 2048 for a Qwen3.5/3.6 hybrid target's default layer types."""
    layer_types: list[str] | None = opt(None, "--layer-types", metavar="TYPE,TYPE,...")
    """Attention of each drafter layer, comma-separated: full_attention or sliding_attention (one per
    layer). None = all full, except for Qwen3.5/3.6 hybrid targets (sliding x4 + full, as released)."""
    method: str | None = opt(None, "--method", check=OneOf(("dflash", "dspark")))
    """The drafter trained: 'dflash' (the DFlash drafter: B inputs draft B - 1 tokens, a weighted cross-entropy)
    or 'dspark' (DSpark, arXiv 2607.05147: the DFlash backbone with a Markov head on the previous token and a
    confidence head; B inputs draft B tokens; 0.1 CE + 0.9 L1 against the target's distribution + 1.0 BCE of the
    confidence; served by SGLang --speculative-algorithm DSPARK and vLLM method dspark, vanilla head only). None =
    dflash, or with init_drafter that drafter's. DSpark's target also runs its last layers and sends its final
    hidden state (+1 feature layer's columns)."""
    markov_rank: int | None = opt(None, "--markov-rank", metavar="RANK", check=POSITIVE)
    """DSpark's Markov head rank r: an embedding [V, r] and a linear r -> V add a previous-token bias to every
    slot's logits (2 x V x r trained weights). None = 256, as DeepSpec and the engines' configs. --method dspark only."""
    markov_head_type: str | None = opt(None, "--markov-head-type", check=OneOf(("vanilla", "gated")))
    """DSpark's Markov head: 'vanilla' (the bias from the previous token alone; served by SGLang and vLLM) or
    'gated' (scaled by a gate on the slot's hidden state; SGLang only). None = vanilla. --method dspark only."""
    confidence_head: bool | None = opt(None, "--confidence-head", off="--no-confidence-head")
    """DSpark's confidence head: one logit per slot predicting its acceptance, trained by BCE against the
    realised acceptance (the report shows its calibration). None = on. --method dspark only."""
    confidence_head_with_markov: bool | None = opt(None, "--confidence-with-markov", off="--confidence-without-markov")
    """Whether the confidence head also reads the previous token's Markov embedding (DeepSpec's default) or the
    slot's hidden state alone. None = with it (when the head is on). --method dspark only."""
    init_drafter: str | None = opt(None, "--init-drafter", metavar="DIR")
    """Warm start: a drafter directory (e.g. a released z-lab drafter) whose config and weights the
    run starts from, to adapt a drafter to your data instead of training one from random weights. Its shape is
    the drafter's: --draft-layers, --block-size and the like that differ from it are refused."""
    init_from_target: bool | None = opt(None, "--init-from-target", off="--random-init")
    """Start the drafter from the target's top layers: every part whose names and shapes match (MLP, norms; an
    attention block only whole), the final norm, fc passing the deepest feature layer through. None = yes
    (unless init_drafter); False (--random-init) = random normal(0, 0.02) weights. From the target trains
    faster: +21-26% acceptance at equal compute in bench/quality.py's comparison."""
    dtype: str = opt("auto", "--dtype", check=OneOf(("auto", "bfloat16", "float32")))
    """Compute dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16 or float32. Master weights and
    optimizer state stay float32 either way; float32 on GPU only to check numerics (slower)."""
    target_fp8: bool = opt(False, "--target-fp8")
    """Run the target's decoder linear layers in FP8 (e4m3 weights with a scale per output channel, activations
    scaled per row: the dynamic recipe vLLM and SGLang serve FP8 with; model/fp8.py): a faster target pass on GPUs
    with FP8 tensor cores (Hopper, Blackwell) and half the memory for its weights. The drafter then learns the
    features an FP8-served target computes, which differ from bf16 ones by FP8's rounding: use it for a target
    you serve in FP8. Off = the target in the compute dtype. Not with --target-parallel above 1."""


@dataclass
class DataConfig:
    """[data] The prepared dataset, how it is packed into batches, and how long training lasts."""

    data: list[str] = opt([], "--data", metavar="DIR", nargs="+")
    """The dataset directory written by `draftline prepare` (train prints the prepare command for
    anything else). Required."""
    token_budget: int = opt(32768, "--token-budget", metavar="TOKENS", check=POSITIVE)
    """Tokens packed into one batch (whole documents, no padding): the unit of work of a target pass
    and a drafter step. Raise it until the GPU's memory is used (preflight says what fits); it must
    hold the longest sample. Drafter memory grows with it."""
    max_batch_size: int = opt(64, "--max-batch-size", metavar="DOCS", check=POSITIVE)
    """Documents per batch at most (caps a batch of many short samples); rarely needs changing."""
    max_anchors: int = opt(512, "--max-anchors", metavar="ANCHORS", check=POSITIVE)
    """Anchors (draft blocks) sampled per document, not per batch: drafter work per token grows with
    it. Lower it when the targets wait on the drafters (q_hs full); raise it for more training signal
    per target pass when the drafters wait."""
    max_length: int | None = opt(None, "--max-length", metavar="TOKENS")
    """Used only in the `draftline prepare` command train prints when --data is not yet a prepared
    dataset: its --max-length, in tokens (default token_budget). It does not truncate prepared data."""
    sort_window: int = opt(1024, "--sort-window", metavar="SAMPLES")
    """Samples per window of the batcher's length sort: it packs documents of similar length
    together within each window of this many, so batches waste few tokens. Larger packs tighter but
    orders the epoch by length over longer stretches; rarely needs changing."""
    balance_steps: bool = opt(True, off="--no-balance-steps")
    """With several batches per optimizer step, give a step's batches similar drafter work (anchor
    counts), so drafters do not wait for each other at the all-reduce. --no-balance-steps: the plain
    shuffle (how runs started before this option ordered their batches; a resume must keep it)."""
    epochs: int = opt(6, "--epochs", metavar="EPOCHS", check=POSITIVE)
    """Passes over the dataset (6 as in the DFlash paper's recipe). Fewer for a large dataset or a
    trial; more for a small one while held-out tau still rises."""
    seed: int = opt(0, "--seed")
    """Seed of the shuffle, the anchor sampling and the drafter's initial weights: the same seed and
    config give the same run."""


@dataclass
class OptimConfig:
    """[optim] AdamW, its schedule, the loss, and the batches of an optimizer step."""

    lr: float = opt(6e-4, "--lr", metavar="LR", check=POSITIVE)
    """Peak learning rate of AdamW (6e-4 as in the DFlash paper's recipe). Lower it for a warm start
    or when the loss spikes; a tiny drafter takes a higher one (the demo's 3-layer one: 3e-3)."""
    min_lr_ratio: float = opt(0.0, "--min-lr-ratio", metavar="RATIO", check=FRACTION)
    """Where the cosine decay ends, as a fraction of lr (0..1; 0 = decays to zero)."""
    warmup_ratio: float = opt(0.04, "--warmup-ratio", metavar="RATIO", check=Within(0, 1, high_open=True))
    """Fraction of all optimizer steps (0..1) spent raising the learning rate linearly from 0 to lr.
    More for large lr or a large batch; 0 for a warm start that should not move at first."""
    weight_decay: float = opt(0.0, "--weight-decay")
    """AdamW weight decay (decoupled, per step, times lr; not applied to norms). 0 as in the recipe."""
    betas: tuple[float, float] = opt((0.9, 0.95), "--betas", metavar="BETA1,BETA2")
    """AdamW's two moment decays, comma-separated (beta1,beta2). Rarely needs changing."""
    grad_clip: float = opt(1.0, "--grad-clip", metavar="NORM", check=NON_NEGATIVE)
    """Clip the global gradient norm (all drafter parameters) to this before each update; 0 = off."""
    loss_gamma: float | None = opt(None, "--loss-gamma", metavar="POSITIONS", check=POSITIVE)
    """Decay of the per-position loss weights exp(-(k-1)/gamma), in block positions (DSpark: exp(-k/gamma) from
    its first slot). None = the paper's for the block size (DFlash: 7 for 16, 5 for 10, 4 for 8, else
    block_size/2; DSpark: 4, as DeepSpec); smaller weights the first positions more, which set most of tau."""
    loss: str | None = opt(None, "--loss", check=OneOf(("dpace", "dflash")))
    """The per-position loss weights: 'dpace' (D-PACE, arXiv 2605.18810: each position's cross-entropy weighted
    by its detached share of the block's expected acceptance length, from the drafter's own probabilities; no
    gamma; 1.05-1.08x the acceptance of 'dflash' in docs/benchmarks/2026-12-dpace.md) or 'dflash' (the paper's
    fixed weights exp(-(k-1)/gamma); needed for --loss-gamma and --distill). None = dpace for DFlash, dflash for
    DSpark (its fixed weights exp(-k/gamma) on its three terms; 'dpace' weighs all three by D-PACE's weights of
    the Markov-corrected cross-entropy). A resume keeps the checkpoint's."""
    dpace_alpha: float = opt(0.5, "--dpace-alpha", metavar="ALPHA", check=Within(0, 1, low_open=True))
    """D-PACE's smoothing, in (0, 1]: a position's acceptance counts as (1 - alpha) q + alpha, q the drafter's
    probability of its label (0.3-0.7 train stably; 0.5 as published). Only with loss = dpace."""
    dspark_loss_weights: tuple[float, float, float] = opt((0.1, 0.9, 1.0), "--dspark-loss-weights",
                                                          metavar="CE,L1,BCE")
    """DSpark's three loss terms' weights, comma-separated: the cross-entropy of the Markov-corrected logits
    against the data's token, the L1 distance between the drafter's and the target's distributions, the
    confidence head's binary cross-entropy (0.1,0.9,1.0: DeepSpec's and SpecForge's). --method dspark only."""
    distill: float = opt(0.0, "--distill", metavar="WEIGHT", check=FRACTION)
    """Soft labels: weight (0..1) of the target's own next-token distribution in each position's label
    (0 = the data's tokens only, the DFlash recipe; 1 = the distribution only). Above 0 the target
    runs all its layers and also sends its final hidden state (more target compute and transfer)."""
    grad_accum: int = opt(1, "--grad-accum", metavar="BATCHES", check=POSITIVE)
    """Batches per optimizer step per drafter rank: a step trains grad_accum x drafters batches. Raise
    it for a larger effective batch without more memory (fewer, larger steps)."""
    global_batch_tokens: int | None = opt(None, "--global-batch-tokens", metavar="TOKENS", check=POSITIVE)
    """Instead of grad_accum: tokens per optimizer step over all drafters (rounded up to whole batches
    of token_budget, an equal number per drafter), so the batch stays the same when the GPU count changes."""
    max_steps: int | None = opt(None, "--max-steps", metavar="STEPS", check=POSITIVE)
    """Stop after this many optimizer steps (a trial, a budget); the learning-rate schedule (warmup,
    cosine) is fitted to these steps, so the trial ends decayed like a whole run. None = all epochs."""
    max_minutes: float | None = opt(None, "--max-minutes", metavar="MINUTES", check=POSITIVE)
    """End the training at the first step boundary after this many minutes of it (counted from this
    start's first step, a resume's too) and finish the run there: final checkpoint, exported drafter,
    final measurement. The learning-rate schedule runs on whichever ends first, the steps or the minutes
    (warmup and cosine over the share of the time spent, where that is further along than the steps),
    so a run the clock ends is annealed to the floor like a whole run; set it for a fixed time on the
    machines (a reservation, a demo). None = no time limit: the steps alone."""
    moments: str = opt("fp32", "--moments", check=OneOf(("fp32", "bf16")))
    """AdamW's two moments in fp32 (torch's fused AdamW: the exact update) or bf16, rounded stochastically: 4
    bytes less per trained weight and moment (-3.9 GiB for the Qwen3-8B shape's drafter: 14.97 GiB against
    18.88 GiB peak for a 3,072-token step on an H200, 153 ms against 152), not the exact update (the quick
    demo's tau 1.808 against 1.788, one seed: docs/benchmarks/2026-12-drafter-memory.md). A resume keeps
    the checkpoint's: a run is resumed with the moments it was saved with."""
    max_bad_steps: int = opt(20, "--max-bad-steps", metavar="STEPS", check=POSITIVE)
    """Consecutive optimizer steps with a non-finite loss or gradient (each skipped, not applied)
    after which training stops with an error; raise it only to ride out a known bad stretch of data."""


@dataclass
class TopologyConfig:
    """[topology] Which ranks run the target and which train the drafter, and the queues between them."""

    targets: int | None = opt(None, "--targets", metavar="RANKS", check=POSITIVE)
    """Ranks running the frozen target; with drafters, must add up to the world size. None = split
    from the FLOP model (`draftline plan` recommends one)."""
    drafters: int | None = opt(None, "--drafters", metavar="RANKS", check=POSITIVE)
    """Ranks training the drafter (data-parallel). None = the rest of the world size after targets."""
    colocated: bool = opt(False, "--colocated")
    """Every rank runs both: a target thread feeds the drafter of its own process (data-parallel
    drafters, no split). Good when targets and drafters would otherwise wait for each other."""
    target_parallel: int = opt(1, "--target-parallel", metavar="RANKS", check=POSITIVE)
    """Ranks per target: each target is a group of this many ranks that runs the model tensor-parallel
    (transformers' plans: attention heads and MLP columns split, MoE experts split), for a target that does not
    fit one GPU (`draftline plan` says which size fits). The group computes each of its batches once and its first
    rank sends the features. targets counts ranks: a multiple of it (--gpus 8 --targets 6 --target-parallel 2:
    3 targets of 2 ranks and 2 drafters). With colocated every rank is a drafter beside one rank of a target
    group: N drafters, N / this many targets. Above 1 acceptance is not measured during training (measure the
    exported drafter afterwards). 1 = one rank per target, the whole model on one GPU."""
    drafter_state: str = opt("auto", "--drafter-state", check=OneOf(("auto", "shard", "replicate")))
    """How several drafter ranks hold the drafter: 'shard' (FSDP2: each keeps 1/D of the weights, gradients
    and AdamW state; layers gathered for each pass), 'replicate' (each keeps all of it; one all-reduce of
    the gradients per step: for a drafter that fits on every rank, where the per-layer gathers cost more
    than they save) or 'auto' (shard on GPU, replicate on CPU, where gloo's gathers made the demo's
    colocated line 1.7-1.9x slower). Either resumes the other's checkpoints."""
    gpus: int | None = opt(None, "--gpus", "--nproc", check=POSITIVE)
    """Launch this many local processes with torchrun (one per GPU; with device cpu, CPU processes),
    as `--gpus N` does. None = as launched: one process, or the ranks torchrun started (under
    torchrun it is ignored)."""
    q_pre: int = opt(8, "--q-pre", metavar="BATCHES", check=POSITIVE)
    """Capacity, in batches, of each target's prefetch queue of ready token batches (built on the
    host). Raise it only if the status shows q_pre empty while targets wait on data."""
    q_hs: int | None = opt(None, "--q-hs", metavar="BATCHES", check=POSITIVE)
    """Capacity, in batches, of the hidden-state queue over all targets (colocated: of each rank's): features
    waiting for a drafter. Larger smooths uneven batches at the cost of memory on the targets (one batch of
    features each); smaller when target memory is short. None = 8, or 2 where a target and its drafter share a GPU
    (colocated, and a single process): there every queued batch sits beside the drafter's passes, and two already
    let the target run a batch ahead."""
    device: str = opt("auto", "--device", check=OneOf(("auto", "cuda", "cpu")))
    """auto (CUDA if available, else CPU), cuda or cpu."""
    failure_timeout_s: float = opt(30.0, "--failure-timeout", metavar="SECONDS", check=POSITIVE)
    """Seconds a rank may go silent before it is declared dead or hung and the run stops with its
    name. Raise it if long pauses (a slow file system, compilation) are expected."""


@dataclass
class CheckpointConfig:
    """[checkpoint] When the run saves, how many saves it keeps, and how it starts."""

    every_steps: int = opt(500, "--save-every", metavar="STEPS")
    """Save a checkpoint every this many optimizer steps (0 = off); a checkpoint is also written at
    the end and on a stop. Lower it when steps are slow or the machine may go away."""
    every_minutes: float = opt(30.0, "--save-every-minutes", metavar="MINUTES")
    """Also save when this many minutes have passed since the last save (0 = off)."""
    keep: int = opt(3, "--keep", metavar="CHECKPOINTS", check=POSITIVE)
    """Checkpoints kept in RUN_DIR/checkpoints; older ones are deleted after a new one is written.
    Each holds the drafter, optimizer and scheduler state in fp32 (about 12 bytes per parameter)."""
    resume: bool = opt(False, "--resume")
    """Continue the run in the output directory from its latest checkpoint (same batches in the same
    order, none twice)."""
    from_scratch: bool = opt(False, "--from-scratch")
    """Start a new run although the output directory holds one (its files are moved aside to
    RUN_DIR/previous-TIME, not deleted)."""


@dataclass
class MonitorConfig:
    """[monitor] The status display, the logs, and the acceptance measured during training."""

    interval_s: float = opt(5.0, "--log-every", metavar="SECONDS")
    """Seconds between status lines (or panel updates) and metrics.jsonl records."""
    tensorboard: bool = opt(True, off="--no-tensorboard")
    """Write TensorBoard events to RUN_DIR/tensorboard (--no-tensorboard: none; RUN_DIR/metrics.jsonl
    is written either way)."""
    wandb: bool = opt(False, "--wandb")
    """Also log to Weights & Biases (needs `pip install wandb` and a login)."""
    wandb_project: str = opt("draftline", "--wandb-project", metavar="NAME")
    """The W&B project the run is logged to (with --wandb)."""
    eval_every: int | None = opt(None, "--eval-every", metavar="STEPS")
    """Measure real acceptance (speculative decoding of held-out prompts: the monitor's tau) every
    this many optimizer steps and at the end; None = about 10 times per run; 0 = only at the end."""
    eval_prompts: str | None = opt(None, "--eval-prompts", metavar="FILE")
    """Prompts for that (JSONL, as `draftline eval --prompts` reads); None = the dataset's held-out
    prompts (`draftline prepare --heldout N`)."""
    eval_num_prompts: int = opt(8, "--eval-num-prompts", metavar="PROMPTS", check=POSITIVE)
    """Prompts used per evaluation during training (the first ones of the set): more reads tau more
    steadily and takes longer."""
    eval_max_new_tokens: int = opt(64, "--eval-max-new-tokens", metavar="TOKENS", check=POSITIVE)
    """Tokens generated per prompt in an evaluation during training."""
    eval_final_num_prompts: int | None = opt(None, "--eval-final-num-prompts", metavar="PROMPTS", check=POSITIVE)
    """Prompts of the final measurement (the monitor's last tau); None = every prompt of the set, as
    `draftline eval` without --limit. A sample of 4 prompts read 0.89x of 24 and varied by 14% (README)."""
    eval_final_max_new_tokens: int = opt(256, "--eval-final-max-new-tokens", metavar="TOKENS", check=POSITIVE)
    """Tokens per prompt in the final measurement; 256 = `draftline eval`'s default --max-new-tokens."""
    peak_tflops: float | None = opt(None, "--peak-tflops", metavar="TFLOPS")
    """Peak dense matrix rate of one device, in TFLOP/s, that MFU is quoted against. None = the GPU's
    spec (known GPUs), else measured at start; set it for a GPU without a spec entry. No MFU on CPU
    unless given."""


@dataclass
class EngineConfig:
    """[engine] How the drafter's step runs: kernels, memory, compilation, checks before training."""

    attention: str = opt("auto", "--attention", check=OneOf(("auto", "flex", "flash", "dense")))
    """Drafter attention: 'auto' (on GPU FlashAttention-4's kernels when ``flash-attn-4`` is installed
    on a Hopper or Blackwell GPU and they pass a first check against dense attention, else flex's
    Triton kernels; dense on CPU), 'flex', 'flash' (flex on FlashAttention-4's kernels, an error
    where they cannot run) or 'dense'."""
    head_chunk_rows: int = opt(4096, "--head-chunk-rows", metavar="ROWS", check=POSITIVE)
    """Rows (block positions) of vocabulary logits materialised at once by the LM head and its loss;
    their memory grows with rows x vocabulary. Lower it if the loss runs out of memory with a large vocabulary."""
    max_query_rows: int = opt(32768, "--max-query-rows", metavar="ROWS")
    """Block rows (anchors x block_size) per drafter pass; a batch with more runs in several passes.
    Lower it when the drafter runs out of memory (preflight names the largest that fits)."""
    recompute: str = opt("cheap", "--recompute", check=OneOf(("none", "cheap", "mlp")))
    """What the drafter's compiled layers recompute in backward instead of keeping (CUDA, compiled):
    'cheap' (norms, SwiGLU product, weight casts: only matrix products' outputs kept; 771 MiB a layer kept
    instead of 1,460 at the Qwen3-8B shape and 8,192 query rows; 152 ms against 148 ms for a 3,072-token step
    on an H200: docs/benchmarks/2026-12-drafter-memory.md), 'mlp' (also the MLP's gate and up projections: two
    more matmuls a layer in backward, 0.375 GiB a layer less at that shape by the accounting, not measured) or
    'none' (what the compiler's partitioner keeps). Whole layers instead: --activation-checkpointing."""
    activation_checkpointing: bool = opt(False, "--activation-checkpointing")
    """Recompute the drafter's layers in backward instead of keeping their activations: less memory,
    about 1/3 more drafter compute. Turn it on when the drafter runs out of memory at the token budget you want."""
    compile: bool = opt(True, off="--no-compile")
    """On CUDA, torch.compile the dense parts of the drafter's training step and of the target's feature
    pass (fused norms, RoPE, SwiGLU, residuals: docs/benchmarks/2026-12-drafter-step.md); ``--no-compile`` runs them eager
    (faster start, slower steps; to rule compilation out when debugging). No effect on CPU."""
    preflight: bool = opt(True, off="--no-preflight")
    """On GPU, run each role's worst-case batch before training and refuse a configuration that would
    run out of memory later, naming what fits; --no-preflight skips it (faster start)."""
    memory_headroom_gib: float = opt(2.0, "--memory-headroom-gib", metavar="GIB")
    """GiB of GPU memory that preflight keeps free (allocator fragmentation, library updates). Raise it
    if a run that passed preflight still runs out of memory."""
    gpu_memory_gib: float | None = opt(None, "--gpu-memory-gib", metavar="GIB", check=POSITIVE)
    """The device memory of each GPU this run may use in all, as CUDA and nvidia-smi count it: torch's allocator
    capped to it less what lies outside the allocator (CUDA context, libraries, NCCL, other processes: measured
    at start and after preflight's warm-up). To try a smaller GPU on a larger one, give the capacity torch
    reports for it (e.g. 94.97 for the RTX PRO 6000 Blackwell, 79.11 for the H100 80GB: `draftline plan --gpu`'s
    table); or to leave room on a shared GPU. None = all of it."""
    trace: bool = opt(False, "--trace")
    """Write RUN_DIR/trace/: each step's loss, and the batches and samples each drafter trained
    (audits, tests). Small files; off by default."""


@dataclass
class TrainConfig:
    """The whole training config: the run directory and one section per concern."""

    out: str = opt("", "--out", metavar="DIR")
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


def sections() -> dict[str, type]:
    """``{name: section class}``, in TrainConfig's order."""
    return {f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(f.default_factory)}


def declared_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """``(section, section class, field)`` of every field declared with ``opt``: ``out`` (section "") first."""
    return [(name, cls, f) for name, cls in {"": TrainConfig, **sections()}.items()
            for f in dataclasses.fields(cls) if option(f) is not None]


def _declared(section: Any, name: str) -> tuple[str, Option]:
    cls = section if isinstance(section, type) else type(section)
    section_name = "" if cls is TrainConfig else next(s for s, c in sections().items() if c is cls)
    declared = option(cls.__dataclass_fields__[name])
    assert declared is not None, f"{cls.__name__}.{name} is not declared with opt()"
    return f"{section_name}.{name}".lstrip("."), declared


def flag_of(section: Any, name: str) -> str:
    """The flag of field ``name`` of ``section`` (a config section or its class), as a message names it."""
    _, declared = _declared(section, name)
    assert declared.flag is not None, f"{name} has no flag"
    return declared.flag


def named(section: Any, name: str) -> str:
    """How a message names a field: its config key and its flag, e.g. ``data.token_budget (--token-budget)``."""
    key, declared = _declared(section, name)
    return f"{key} ({declared.flag})" if declared.flag else key


def _check_declared(config: TrainConfig) -> None:
    """Each field's own range or choices, as ``opt`` declared them; None passes where the type allows it."""
    for section_name, cls, f in declared_fields():
        section = getattr(config, section_name) if section_name else config
        value, check = getattr(section, f.name), option(f).check
        if check is None or (value is None and _optional(field_types(cls)[f.name])):
            continue
        if not check.allows(value):
            raise DraftlineError(f"{named(section, f.name)} must be {check}, got {value!r}")


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def resolved_loss(config: TrainConfig) -> str:
    """The objective's per-position weights (``objective.loss.ObjectiveSettings.loss``): ``optim.loss``; None gives
    each method its default (DFlash: 'dpace'; DSpark: 'dflash', its fixed weights exp(-k/gamma))."""
    return default_loss(config.model.method, config.optim.loss)


def default_loss(method: str | None, loss: str | None) -> str:
    """``resolved_loss`` of a method and an ``optim.loss`` (a checkpoint's saved config, say)."""
    return loss or ("dflash" if method == "dspark" else "dpace")


def default_q_hs(q_hs: int | None, colocated: bool) -> int:
    """The hidden-state queue's capacity: ``topology.q_hs``, or its default for the layout (``TopologyConfig.q_hs``)."""
    if q_hs is not None:
        return q_hs
    return 2 if colocated else 8


DSPARK_ONLY = ("markov_rank", "markov_head_type", "confidence_head", "confidence_head_with_markov")
"""The [model] fields of DSpark's heads (set only with method = dspark)."""


def check_method(config: TrainConfig) -> None:
    """The method's own options with their method; DSpark with the options it does not combine with."""
    m, o = config.model, config.optim
    method = flag_of(m, "method")
    if m.method != "dspark":
        given = [_declared(m, name)[1].flag for name in DSPARK_ONLY if getattr(m, name) is not None]
        if tuple(o.dspark_loss_weights) != (0.1, 0.9, 1.0):
            given.append(flag_of(o, "dspark_loss_weights"))
        if given:
            raise DraftlineError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} DSpark's heads or loss: add "
                                 f"{method} dspark, or drop {'it' if len(given) == 1 else 'them'}")
        return
    if o.distill > 0:
        raise DraftlineError(f"{flag_of(o, 'distill')} mixes the target's distribution into DFlash's labels; "
                             f"{method} dspark distils it already (its L1 term): drop {flag_of(o, 'distill')}")
    if m.confidence_head is False and m.confidence_head_with_markov:
        raise DraftlineError(f"{_declared(m, 'confidence_head_with_markov')[1].flag} feeds a confidence head that "
                             f"{_declared(m, 'confidence_head')[1].off} turns off: drop one")
    if any(not w >= 0 for w in o.dspark_loss_weights) or not any(o.dspark_loss_weights[:2]):
        raise DraftlineError(f"{named(o, 'dspark_loss_weights')} = {list(o.dspark_loss_weights)}: each weight must be "
                             ">= 0, and CE or L1 above 0 (the BCE term trains the confidence head alone)")


def validate(config: TrainConfig) -> None:
    """Raise DraftlineError naming the field and the fix for anything that cannot run: the required
    fields, each field's own range or choices, then the rules between fields."""
    m, d, o, c, e = config.model, config.data, config.optim, config.checkpoint, config.engine
    for section, name, what in ((config, "out", "the run directory for checkpoints and metrics"),
                                (m, "target", "the target model directory"),
                                (d, "data", "a prepared dataset directory or input files")):
        if not getattr(section, name):
            key, declared = _declared(section, name)
            raise DraftlineError(f"{key} ({declared.flag} {declared.metavar}) is required: {what}")
    _check_declared(config)
    if d.max_length is not None and d.max_length > d.token_budget:
        raise DraftlineError(
            f"data.max_length={d.max_length} exceeds data.token_budget={d.token_budget}: a sample must fit in one batch; "
            f"lower {flag_of(d, 'max_length')} or raise {flag_of(d, 'token_budget')}")
    if o.global_batch_tokens is not None and o.grad_accum != 1:
        raise DraftlineError(
            f"optim.global_batch_tokens ({flag_of(o, 'global_batch_tokens')} {o.global_batch_tokens}) and optim.grad_accum "
            f"({flag_of(o, 'grad_accum')} {o.grad_accum}) both set the batches of an optimizer step; pick one")
    check_method(config)
    loss, gamma, distill = flag_of(o, "loss"), flag_of(o, "loss_gamma"), flag_of(o, "distill")
    if resolved_loss(config) == "dpace" and o.loss_gamma is not None:
        raise DraftlineError(f"{named(o, 'loss_gamma')} weighs the dflash loss; {loss} dpace sets its own "
                             f"weights: drop {gamma} or use {loss} dflash")
    if resolved_loss(config) == "dpace" and o.distill > 0:
        raise DraftlineError(f"{loss} dpace weighs hard labels by the drafter's probability of them; it does not "
                             f"combine with {distill}: drop one")
    if m.init_drafter and m.init_from_target is not None:
        switch = _declared(m, "init_from_target")[1]
        chosen = switch.flags[0] if m.init_from_target else switch.off
        raise DraftlineError(f"{flag_of(m, 'init_drafter')} and {chosen} both set the starting weights; pick one")
    t = config.topology
    if m.target_fp8 and t.target_parallel > 1:
        raise DraftlineError(f"{flag_of(m, 'target_fp8')} converts a whole target's linear layers; a target split "
                             f"over ranks ({named(t, 'target_parallel')} = {t.target_parallel}) keeps its dtype: "
                             f"drop one of the two")
    if t.targets is not None and t.targets % t.target_parallel:
        raise DraftlineError(
            f"{named(t, 'targets')} = {t.targets} counts the ranks of the target groups of "
            f"{named(t, 'target_parallel')} = {t.target_parallel}: make it a multiple "
            f"({t.targets // t.target_parallel * t.target_parallel or t.target_parallel} or "
            f"{(t.targets // t.target_parallel + 1) * t.target_parallel})")
    if c.resume and c.from_scratch:
        raise DraftlineError(f"{flag_of(c, 'resume')} and {flag_of(c, 'from_scratch')} contradict each other; pick one")
    if e.max_query_rows < (m.block_size or 2):
        raise DraftlineError(f"{named(e, 'max_query_rows')} = {e.max_query_rows} must hold at least one block "
                             f"({m.block_size} rows)")
