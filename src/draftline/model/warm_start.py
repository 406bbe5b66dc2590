"""Start a drafter from the target's own top layers instead of from noise.

The drafter's layers have the target's sizes and Qwen3's parameter names, so the target's last
``num_hidden_layers`` decoder layers can be copied in; its final ``norm`` takes the target's (the
frozen LM head expects hidden states at that scale); ``fc`` starts by passing the deepest feature
layer through unchanged. The drafter then begins as "the top of the target, attending to the
target's own hidden states", which trains much faster than random weights when data is scarce
(the built-in demo); at scale, measure both.

Only whole parts are copied, each where every tensor has the drafter's names and shapes: the MLP,
each norm, and the attention block only when all of q/k/v/o and the q/k norms match. Hybrid targets
(Qwen3.5/3.6): their top layers are mostly Gated DeltaNet, and their full-attention layers have
another head shape than the public drafter's (gated 24 x 256 against 32 x 128), so MLPs and norms
start from the target; their RMSNorms store ``w - 1`` (the layer applies ``1 + w``), which becomes
the drafter's plain ``w``. Vision-language checkpoints are read under their language model's names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from draftline.errors import DraftlineError
from draftline.model.drafter import DFlashDrafter
from draftline.model.target import TargetWeights

# RMSNorm classes that scale by ``1 + weight`` (the stored weight is centred on zero).
_ZERO_CENTRED_NORMS = ("Qwen3_5", "Qwen3Next", "Gemma")


def _zero_centred(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return "RMSNorm" in name and name.startswith(_ZERO_CENTRED_NORMS)


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target_dir: str | Path, config: PretrainedConfig) -> list[str]:
    """Copy the target's top layers and final norm into ``drafter``; returns what was copied. ``config``: the
    target's config as its directory holds it (``load_target_config``), read once by the caller."""
    weights = TargetWeights(target_dir, config)
    decoder = weights.skeleton.get_decoder()
    num_target = len(decoder.layers)
    num_draft = len(drafter.layers)
    if num_draft > num_target:
        raise DraftlineError(f"the drafter has {num_draft} layers, the target only {num_target}: cannot copy its top layers")
    copied = []

    def read(name: str) -> torch.Tensor | None:
        tensor = weights.read(name) if weights.has(name) else None
        if tensor is None:
            return None
        owner = weights.skeleton.get_submodule(name.rsplit(".", 1)[0])
        return tensor.float() + 1.0 if _zero_centred(owner) else tensor

    for i, layer in enumerate(drafter.layers):
        source = weights.name_of(decoder.layers[num_target - num_draft + i])
        # A part starts from the target only whole: an attention block with one tensor of another shape (another
        # head shape) keeps its fresh init; what the target lacks (a Llama's q/k norms, the attention of a Gated
        # DeltaNet layer) stays fresh too.
        for part_name, part in layer.named_children():
            values = {}
            for name, param in part.named_parameters():
                full = f"{source}.{part_name}.{name}"
                value = read(full)
                if value is not None and tuple(value.shape) != tuple(param.shape):
                    values = {}
                    break
                if value is not None:
                    values[name] = value
            for name, value in values.items():
                part.get_parameter(name).copy_(value.to(part.get_parameter(name).dtype))
                copied.append(f"layers.{i}.{part_name}.{name} <- {source}.{part_name}.{name}")
    norm = read(f"{weights.name_of(decoder.norm)}.weight")
    if norm is not None and norm.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.to(drafter.norm.weight.dtype))
        copied.append("norm")
    hidden = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden, dtype=drafter.fc.weight.dtype))
    copied.append("fc = identity on the deepest feature layer")
    if not any(c.startswith("layers.") for c in copied):
        raise DraftlineError(f"{target_dir}: none of the target's layer tensors match the drafter's names and shapes")
    return copied
