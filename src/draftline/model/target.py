"""The frozen target: features for the drafter, and its embedding and LM head.

``TargetFeatures`` loads a Hugging Face causal LM with only the decoder layers up to the deepest
feature layer (the rest and the LM head are never run) and returns, for a packed batch, the
concatenated outputs of the selected layers. With ``final_hidden`` (soft-label training) it runs
every layer and appends the final-normed last hidden state, what the LM head reads.

Documents in a batch do not see each other. On GPU the batch runs as one packed row: attention
layers get a block-sparse per-document causal mask (flex attention), and the Gated DeltaNet layers
of hybrid targets (Qwen3.5/3.6) get the documents' boundaries (``model/linear_attention.py``). On
CPU each document is a padded row of its own. A vision-language checkpoint
(``*ForConditionalGeneration``) loads as its text model: the vision tower and MTP weights are
never read into memory. Given a target group's process group, the target is split over the group's ranks by
transformers' tensor-parallel plans (``model/target_parallel.py``) and every rank returns the same features.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from draftline.data.batch import PackedBatch
from draftline.errors import DraftlineError
from draftline.model import linear_attention, target_parallel
from draftline.model.config import text_config
from draftline.model.fp8 import ALIGN, convert_linears


def load_target_config(target_dir: str | Path) -> PretrainedConfig:
    """The target's config (a fresh copy each call: callers may change it); config.json is read once."""
    path = Path(target_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DraftlineError(f"{path}: no config.json; --target must be a Hugging Face model directory")
    stat = config_file.stat()
    return copy.deepcopy(_read_config(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _read_config(path: str, _mtime_ns: int, _size: int) -> PretrainedConfig:
    return AutoConfig.from_pretrained(path)


@contextmanager
def _quiet_transformers():
    # The library's root logger: its children inherit the level (setting a child's own level would
    # turn on extra checks in from_pretrained that only warn).
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _truncate_layers(text: PretrainedConfig, num_layers: int) -> None:
    """``text`` (a text config, changed in place) describes its first ``num_layers`` layers only."""
    text.num_hidden_layers = num_layers
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(text, name, None)
        if isinstance(value, list) and len(value) > num_layers:
            setattr(text, name, value[:num_layers])


def convert_to_fp8(model) -> None:
    """The decoder layers' linear layers in FP8 (``model/fp8.py``); the embedding and the LM head keep their dtype.
    Logs how many were converted, and how many FP8 could not take."""
    counts = convert_linears(model.get_decoder().layers)
    logging.getLogger(__name__).info("target in FP8: %d linear layers converted, %d kept (dimensions not multiples "
                                     "of %d)", counts["converted"], counts["kept"], ALIGN)


class _StopForward(Exception):
    """Raised after the deepest feature layer: the layers after it (and the head) need not run."""


_FLEX = ("flex_attention", linear_attention.PACKED_FLEX)


def default_attention(device: torch.device, hybrid: bool = False) -> str:
    """flex attention (packed documents, block-sparse) on GPU; SDPA (one padded row per document) on CPU.
    ``hybrid``: the target has Gated DeltaNet layers."""
    if device.type != "cuda":
        return "sdpa"
    if hybrid:
        return linear_attention.register_packed_flex()  # the hybrid classes refuse "flex_attention" by name
    return "flex_attention"


class TargetFeatures:
    """Runs the target up to its deepest feature layer; returns fused features [T, K * H].

    ``keep_all_layers=True`` keeps the whole model (with its LM head) so that the same copy can
    also decode for evaluation; feature extraction still stops after the deepest feature layer.
    """

    def __init__(
        self,
        target_dir: str | Path,
        layer_ids: list[int],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        attn_implementation: str | None = None,
        keep_all_layers: bool = False,
        final_hidden: bool = False,
        packed: bool | None = None,
        config: PretrainedConfig | None = None,
        group: "torch.distributed.ProcessGroup | None" = None,
        fp8: bool = False,
    ):
        """``packed``: one packed row per batch (default: with flex attention, i.e. on GPU); ``config``: the
        target's config already read (``ModelSpec.target_file_config``; copied, not changed), else read here;
        ``group``: the target group's process group, to split the target over its ranks
        (``model/target_parallel.py``; every rank of the group builds it, and each then returns the same features);
        ``fp8``: the decoder layers' linear layers in FP8 (``model/fp8.py``), converted before the weights move to
        ``device``; a whole target only."""
        device = torch.device(device)
        self.layer_ids = list(layer_ids)
        self.target_dir = target_dir
        config = copy.deepcopy(config) if config is not None else load_target_config(target_dir)
        self.group_size = torch.distributed.get_world_size(group) if group is not None else 1
        target_parallel.check_group_size(config, self.group_size)
        text = text_config(config)
        hybrid = linear_attention.is_hybrid(text)
        if device.type == "cpu" and hybrid and importlib.util.find_spec("fla"):
            raise DraftlineError(
                f"{target_dir}: a hybrid target on CPU with flash-linear-attention installed: transformers then runs "
                "its Gated DeltaNet layers with fla's GPU-only kernels. Run on a GPU, or uninstall "
                "flash-linear-attention for a CPU run."
            )
        num_layers = int(text.num_hidden_layers)
        if max(self.layer_ids) >= num_layers or min(self.layer_ids) < 0:
            raise DraftlineError(f"target_layer_ids {self.layer_ids} outside the target's {num_layers} layers")
        self._set_layers(num_layers, final_hidden)
        if not keep_all_layers:
            _truncate_layers(text, self.layers_run)
        attn = attn_implementation or default_attention(device, hybrid)
        if attn == linear_attention.PACKED_FLEX:
            linear_attention.register_packed_flex()
        if device.type == "cuda" and hybrid and (attn in _FLEX if packed is None else packed):
            linear_attention.fla_kernels()  # before reading the weights: name the install command at once
        with _quiet_transformers():
            if self.group_size > 1:
                if fp8:
                    raise DraftlineError("an FP8 target is converted whole: a target split over ranks keeps its dtype")
                model = target_parallel.load_split(target_dir, config, group, device=device, dtype=dtype,
                                                   attn_implementation=attn)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    target_dir, config=config, dtype=dtype, attn_implementation=attn
                )
                if fp8:
                    convert_to_fp8(model)
                model = model.to(device)
        self._wrap(model, attn, packed, hybrid)

    @classmethod
    def from_model(cls, model, layer_ids: list[int], *, keep_all_layers: bool = False,
                   final_hidden: bool = False, packed: bool | None = None, fp8: bool = False) -> "TargetFeatures":
        """Wrap an in-memory causal LM (benchmarks, tests); drops the unused layers unless told not to; ``fp8``:
        converts its decoder layers' linear layers in place, where they are."""
        self = cls.__new__(cls)
        self.layer_ids = list(layer_ids)
        self.target_dir = None
        self.group_size = 1
        text = text_config(model.config)
        self._set_layers(int(text.num_hidden_layers), final_hidden)
        if not keep_all_layers:
            decoder = model.get_decoder()
            decoder.layers = decoder.layers[: self.layers_run]
            _truncate_layers(text, self.layers_run)
        if fp8:
            convert_to_fp8(model)
        self._wrap(model, model.config._attn_implementation, packed, linear_attention.is_hybrid(text))
        return self

    def _set_layers(self, num_layers: int, final_hidden: bool) -> None:
        # HF's hidden_states[L] (what inference code reads for the last layer) is after the final norm.
        self._normed = {num_layers - 1}
        self._outputs = self.layer_ids + ([num_layers - 1] if final_hidden else [])
        self.layers_run = max(self._outputs) + 1

    def _wrap(self, model, attn: str, packed: bool | None, hybrid: bool) -> None:
        model.requires_grad_(False).eval()
        self.model = model
        self.attn = attn
        self.packed = attn in _FLEX if packed is None else packed
        self.decoder = model.get_decoder()
        self.device = next(model.parameters()).device
        # Per thread: in the colocated mode another thread may decode with the same model (evaluation).
        self._local = threading.local()
        self._deepest = max(self._outputs)
        for layer_id in set(self._outputs):
            self.decoder.layers[layer_id].register_forward_hook(self._hook(layer_id))
        self.hybrid = hybrid
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None  # a split target's embedding and head, unsplit
        self._kernels = None
        self.linear_stages = linear_attention.Stages()
        """A Gated DeltaNet layer's stages around fla's kernels in a packed pass (compiled by
        ``model.fused.compile_target``)."""
        if self.hybrid and self.packed:
            for layer in self.decoder.layers:
                if hasattr(layer, "linear_attn"):
                    self._pack_linear_attention(layer.linear_attn)
            if self.device.type == "cuda":
                self._kernels = linear_attention.fla_kernels()  # fail at load, naming the install command

    def _pack_linear_attention(self, module: torch.nn.Module) -> None:
        """In a packed feature pass the layer runs ``packed_forward``; otherwise its own forward."""
        linear_attention.check_layer(module)
        own_forward = module.forward

        def forward(hidden_states, *args, **kwargs):
            cu_seqlens = getattr(self._local, "cu_seqlens", None)
            if cu_seqlens is None:
                return own_forward(hidden_states, *args, **kwargs)
            if self._kernels is None:
                self._kernels = linear_attention.fla_kernels()
            return linear_attention.packed_forward(module, hidden_states, cu_seqlens, self._kernels,
                                                   self.linear_stages)

        module.forward = forward

    def _hook(self, layer_id: int):
        def capture(_module, _inputs, output):
            captured = getattr(self._local, "captured", None)
            if captured is None:  # a forward that is not a feature pass (e.g. evaluation)
                return
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self._deepest:
                raise _StopForward

        return capture

    def in_feature_pass(self) -> bool:
        """True inside ``__call__`` on this thread (not while the same model decodes for evaluation)."""
        return getattr(self._local, "captured", None) is not None

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.model.config).hidden_size)

    @property
    def feature_width(self) -> int:
        """Columns of what ``__call__`` returns: K feature layers (+ the final hidden state)."""
        return len(self._outputs) * self.hidden_size

    @torch.no_grad()  # not inference_mode: the drafter's autograd graph starts from these features
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        if self.packed:
            return self._packed(batch)
        return self._padded(batch)

    def _run(self, **inputs) -> dict[int, torch.Tensor]:
        # The hook after the deepest feature layer stops the forward: later layers never run.
        captured: dict[int, torch.Tensor] = {}
        self._local.captured = captured
        try:
            self.decoder(use_cache=False, **inputs)
        except _StopForward:
            pass
        finally:
            self._local.captured = None
        return captured

    def _fuse(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        parts = [self.decoder.norm(captured[i]) if i in self._normed else captured[i] for i in self._outputs]
        return torch.cat(parts, dim=-1)

    def _packed(self, batch: PackedBatch) -> torch.Tensor:
        """One row, a document-causal mask: no padding, no cross-document work (GPU).

        flex attention gets our block-sparse mask; other implementations (CPU tests) a dense one.
        Gated DeltaNet layers get the documents' ``cu_seqlens`` through ``self._local``.
        """
        input_ids = batch.input_ids.to(self.device, non_blocking=True)[None]
        positions = batch.positions().to(self.device, non_blocking=True)[None]
        mask = self._document_mask(batch.doc_lengths)
        if not self.hybrid:
            return self._fuse(self._run(input_ids=input_ids, position_ids=positions, attention_mask=mask))[0]
        cu_seqlens = torch.zeros(batch.doc_lengths.numel() + 1, dtype=torch.long)
        torch.cumsum(batch.doc_lengths, 0, out=cu_seqlens[1:])
        self._local.cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)
        try:
            masks = {"full_attention": mask, "linear_attention": None}
            return self._fuse(self._run(input_ids=input_ids, position_ids=positions, attention_mask=masks))[0]
        finally:
            self._local.cu_seqlens = None

    def _document_mask(self, doc_lengths: torch.Tensor):
        if self.attn in _FLEX:
            from draftline.model.attention import document_causal_block_mask

            return document_causal_block_mask(doc_lengths, self.device)
        doc = torch.repeat_interleave(torch.arange(doc_lengths.numel()), doc_lengths.cpu()).to(self.device)
        causal = torch.ones(doc.numel(), doc.numel(), dtype=torch.bool, device=self.device).tril()
        return (causal & (doc[:, None] == doc[None, :]))[None, None]

    def _padded(self, batch: PackedBatch) -> torch.Tensor:
        """One padded row per document (SDPA, CPU): a packed row would cost a dense [T, T] mask."""
        lengths = batch.doc_lengths.tolist()
        longest = max(lengths)
        rows = len(lengths)
        input_ids = torch.zeros(rows, longest, dtype=torch.long)
        attention = torch.zeros(rows, longest, dtype=torch.long)
        for row, (start, length) in enumerate(zip(batch.doc_starts().tolist(), lengths)):
            input_ids[row, :length] = batch.input_ids[start : start + length]
            attention[row, :length] = 1
        keep = attention.bool().reshape(-1).to(self.device)
        fused = self._fuse(self._run(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)))
        return fused.reshape(rows * longest, -1)[keep]

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (a split target's too: a DTensor's shape is the whole tensor's)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    def embed_weight(self) -> torch.Tensor:
        """The input embedding [V, H], whole (a split target's is read unsplit from its checkpoint, once)."""
        if self.group_size > 1:
            return self._unsplit()[0]
        return self.model.get_input_embeddings().weight

    def head_weight(self) -> torch.Tensor:
        """The LM head [V, H], whole (the embedding when tied; a split target's is read unsplit, once)."""
        if self.group_size > 1:
            return self._unsplit()[1]
        head = self.model.get_output_embeddings()
        return head.weight if head is not None else self.embed_weight()

    def _unsplit(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A target split by its heads holds 1/K of the vocabulary's rows of its embedding and head on each rank
        (DTensors). Gathering them would be a collective that every rank of the group must enter at once; reading them
        from the checkpoint lets one rank ask alone (a colocated drafter's objective, soft labels). Split by its
        experts alone, it holds them whole: those are returned."""
        if self._whole is None:
            weight = self.model.get_input_embeddings().weight
            head = self.model.get_output_embeddings()
            head = head.weight if head is not None else weight
            if not hasattr(weight, "to_local") and not hasattr(head, "to_local"):
                self._whole = (weight, head)  # split by its experts alone: the embedding and head are whole here
            else:
                self._whole = load_embedding_and_head(self.target_dir, device=self.device, dtype=weight.dtype)
        return self._whole


def _safetensors_index(target_dir: Path) -> dict[str, Path]:
    index_file = target_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: target_dir / fname for name, fname in weight_map.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise DraftlineError(f"{target_dir}: no model.safetensors or index; save the target with save_pretrained")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


class TargetWeights:
    """The target's tensors read one at a time by their module names, without loading the model: a skeleton
    of the model on the meta device gives the names, the checkpoint's safetensors files the values (under a
    vision-language model's language model too)."""

    def __init__(self, target_dir: str | Path, config: PretrainedConfig):
        self.target_dir = Path(target_dir)
        with torch.device("meta"), _quiet_transformers():
            self.skeleton = AutoModelForCausalLM.from_config(config)
        self.files = _safetensors_index(self.target_dir)

    def name_of(self, module: torch.nn.Module) -> str:
        """``module``'s name in the skeleton."""
        for name, candidate in self.skeleton.named_modules():
            if candidate is module:
                return name
        raise DraftlineError(f"{self.target_dir}: could not locate {type(module).__name__} in the target by name")

    def has(self, name: str) -> bool:
        """Whether the skeleton has a parameter of this name."""
        try:
            self.skeleton.get_parameter(name)
        except AttributeError:
            return False
        return True

    def read(self, name: str) -> torch.Tensor | None:
        """The stored tensor of parameter ``name`` (its dtype as stored), or None where the checkpoint lacks it."""
        stored = _stored_name(name, self.files)
        if stored is None:
            return None
        with safe_open(self.files[stored], framework="pt", device="cpu") as f:
            return f.get_tensor(stored)


def load_embedding_and_head(
    target_dir: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    config: PretrainedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H], read without loading the model; ``config``: the
    target's config already read (else read here)."""
    weights = TargetWeights(target_dir, config if config is not None else load_target_config(target_dir))
    embed_name = f"{weights.name_of(weights.skeleton.get_input_embeddings())}.weight"
    embed = weights.read(embed_name)
    if embed is None:
        raise DraftlineError(f"{target_dir}: the checkpoint has no {embed_name} (nor a vision-language model's copy)")
    output = weights.skeleton.get_output_embeddings()
    head = weights.read(f"{weights.name_of(output)}.weight") if output is not None else None
    embed = embed.to(device=device, dtype=dtype or embed.dtype)
    return embed, embed if head is None else head.to(device=device, dtype=dtype or head.dtype)  # None: tied


def _stored_name(name: str, files: dict[str, Path]) -> str | None:
    """``name`` as the checkpoint stores it: as is, or under a vision-language model's language model."""
    candidates = [name]
    if name.startswith("model."):
        rest = name.removeprefix("model.")
        candidates += [f"model.language_model.{rest}", f"language_model.model.{rest}"]
    else:
        candidates += [f"language_model.{name}"]
    return next((c for c in candidates if c in files), None)
