"""The serving check's vocabulary: the engine versions read, every rule by id, findings and the check's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import PretrainedConfig

from draftline.errors import DraftlineError

# The engine code these rules were read from (their DFlash loaders, config parsing and weight loading).
ENGINES_READ = {"vLLM": "0.33.0", "SGLang": "0.5.23"}
VLLM = f"vLLM {ENGINES_READ['vLLM']}"
SGLANG = f"SGLang {ENGINES_READ['SGLang']}"
SPECULATORS = "speculators 0.9.0"
BOTH = f"{VLLM}, {SGLANG}"

# Every rule by id, with the code it describes. tests/checkpoint/test_serving.py holds a drafter broken
# for each id and checks that every id here is exercised (the ``dspark.*`` ones: test_dspark_serving.py).
RULES: dict[str, str] = {
    # config.json: what the engines build
    "architectures": BOTH, "model_type": BOTH, "dflash_config": BOTH, "block_size": BOTH,
    "dflash_config.block_size": SGLANG, "dflash_config.num_target_layers": SGLANG,
    "dflash_config.mask_token_id": SGLANG, "mask_token": SGLANG,
    "is_causal": BOTH, "dflash_config.causal": VLLM, "dflash_config.use_swa": VLLM,
    "use_aux_hidden_state": VLLM, "is_neox_style": BOTH, "rope_is_neox_style": SGLANG, "use_gemma_norm": SGLANG,
    "attention_bias": BOTH, "hidden_act": BOTH, "dflash_config.attention_sink_bias": BOTH,
    "add_swa_attention_sink_bias": VLLM, "dflash_config.attention_value_scale": BOTH,
    "dflash_config.conv_kernel_size": SGLANG, "dflash_config.selector_rank": SGLANG,
    "dflash_config.selector_top_k": SGLANG, "projector_type": SGLANG, "quantization": BOTH,
    "rope_parameters.rope_dim": BOTH, "rope_parameters.partial_rotary_factor": VLLM,
    "rope_parameters.mrope_section": VLLM, "rope_parameters.target": BOTH,
    # config.json against the target
    "hidden_size": BOTH, "vocab_size": VLLM, "target_hidden_size": VLLM, "draft_vocab_size": VLLM,
    "num_target_layers": SGLANG, "mask_token_id.range": SGLANG, "tokenizer_mask_token": SGLANG,
    "target_layer_ids": BOTH, "target_layer_ids.range": BOTH, "target_layer_ids.order": BOTH,
    "target_layer_ids.last_layer": f"{BOTH}, {SPECULATORS}", "eagle_aux_hidden_state_layer_ids": VLLM,
    # attention layers
    "layer_types": BOTH, "layer_types.unknown": BOTH, "use_sliding_window": BOTH, "sliding_window": BOTH,
    "dflash_config.swa_window_size": VLLM, "mixed_layers": VLLM, "max_position_embeddings": BOTH,
    # files and tensors
    "model.safetensors": BOTH, "weight_files": VLLM, "mask_embedding.pt": BOTH, "sizes": BOTH,
    "model_prefix": BOTH, "embed_tokens_lm_head": f"{BOTH}, {SPECULATORS}", "vocab_map": BOTH,
    "unknown_tensors": BOTH, "missing_tensors": BOTH, "tensor_shape": BOTH,
    # a DSpark drafter (dspark_rules; the backbone's rules above apply to it too)
    "dspark.architectures": BOTH, "dspark.block_size": BOTH, "dspark.mask_token_id": SGLANG,
    "dspark.dflash_config": BOTH, "dspark.speculators_model_type": SGLANG, "dspark.sample_from_anchor": VLLM,
    "dspark.markov_rank": SGLANG, "dspark.markov_head_type": BOTH, "dspark.markov_head_type.vllm": VLLM,
    "dspark.confidence_flags": BOTH, "dspark.confidence_head_with_markov": BOTH, "dspark.confidence_head_off": SGLANG,
}

# The warning for a drafter whose layers mix sliding-window and full attention.
MIXED_LAYERS_WARNING = (f"layer_types mixes sliding_attention and full_attention: {VLLM} runs such a drafter only on "
                        "its V2 model runner (its default; it refuses the drafter on V1): serve with "
                        "VLLM_USE_V2_MODEL_RUNNER=1")

# SGLang's default mask token string, looked up in the target's tokenizer (dflash_config.mask_token).
SGLANG_DEFAULT_MASK_TOKEN = "<|MASK|>"


@dataclass(frozen=True)
class Finding:
    rule: str
    """Its id in ``RULES``."""
    subject: str
    """The field, tensor or file at fault."""
    problem: str
    fix: str
    kind: str = "serving"
    """'target': the drafter does not fit this target; 'serving': an engine would load it differently; 'vllm':
    vLLM alone would (SGLang serves it: the export goes ahead, with a warning)."""

    def __post_init__(self) -> None:
        assert self.rule in RULES, self.rule

    def __str__(self) -> str:
        return f"{self.subject}: {self.problem}. Fix: {self.fix}"


@dataclass
class ServingCheck:
    """What ``inspect_drafter_dir`` found; ``raise_if_refused`` turns findings into one error."""

    path: Path
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    """The rule ids of ``warnings``, in order."""
    data: dict = field(default_factory=dict)
    """The directory's config.json as read."""
    config: PretrainedConfig | None = None
    """The drafter config it describes (None where it builds none)."""
    config_error: str = ""
    """Why ``config`` is None."""

    def refused(self, kinds: tuple[str, ...] = ("target", "serving")) -> list[Finding]:
        return [f for f in self.findings if f.kind in kinds]

    def add(self, rule: str, subject: str, problem: str, fix: str, kind: str = "serving") -> None:
        self.findings.append(Finding(rule, subject, problem, fix, kind))

    def warn(self, rule: str, text: str) -> None:
        assert rule in RULES, rule
        self.warnings.append(text)
        self.warned.append(rule)

    def raise_if_refused(self, kinds: tuple[str, ...] = ("target", "serving")) -> None:
        refused = self.refused(kinds)
        if refused:
            raise DraftlineError(
                f"{self.path}: {engines()} would not load this drafter as it was trained "
                f"({count(refused)}; rules read from their sources, not a run of their code):\n"
                + "\n".join(f"  - {f}" for f in refused)
            )


def engines() -> str:
    return " and ".join(f"{name} {version}" for name, version in ENGINES_READ.items())


def count(findings: list) -> str:
    return f"{len(findings)} problem{'s' if len(findings) > 1 else ''}"
