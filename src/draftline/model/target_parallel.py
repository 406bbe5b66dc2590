"""The frozen target split over a target group of K ranks (tensor parallel), by transformers' own plans.

transformers applies the model's ``base_model_tp_plan``: attention heads and MLP columns split over the K ranks,
each layer ending in two all-reduces of ``[tokens, hidden]`` (after ``o_proj`` and after ``down_proj``); a Gated
DeltaNet layer (Qwen3.5/3.6) splits its projections' columns and gathers their outputs, so its recurrence runs
whole on every rank. A MoE model also gets its ``base_model_ep_plan``: whole experts per rank (``num_experts / K``),
every rank routing the same tokens and one all-reduce summing the experts' outputs. Each rank reads only its shard
of each weight from the checkpoint. After every layer each rank holds the whole hidden state, so every rank of
the group computes the same features.

A MoE target whose attention heads (or key/value heads) do not divide by K, but whose experts do (Qwen3-235B-A22B's
4 key/value heads over 8 ranks), is split by its experts alone (``EXPERTS``: transformers' expert-parallel plan with
no tensor-parallel rule, ``ep_size = tp_size, tp_plan = {}``): attention, embedding, head and any dense layer whole on
every rank (their compute repeated on each), the experts ``num_experts / K`` per rank, one all-reduce per MoE layer.

transformers 5 builds its mesh over the whole job (``WORLD_SIZE`` must equal the product of its parallel sizes) and
does not take a ``device_mesh`` with a ``distributed_config``. A target group is part of a larger job (the drafter
ranks, the other groups), so its mesh here is made from the group's own process group and handed to transformers at
the one place ``from_pretrained`` asks for it (the model class's ``prepare_distribute_model``); everything else
(the plans, the sharded reading, the expert routing) is transformers'.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, PretrainedConfig

from draftline.errors import DraftlineError
from draftline.model.config import text_config


def num_experts(text: PretrainedConfig) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)


TENSOR = "tensor"
"""Heads, MLP columns (and experts) split over the group: two all-reduces of [tokens, hidden] per layer."""
EXPERTS = "experts"
"""A MoE target's experts alone split over the group, the rest whole on every rank: one all-reduce per MoE layer."""


def _sizes(text: PretrainedConfig) -> dict[str, int]:
    heads = int(text.num_attention_heads)
    sizes = {"attention heads": heads, "key/value heads": int(getattr(text, "num_key_value_heads", None) or heads)}
    if num_experts(text):
        sizes["experts"] = num_experts(text)
    return sizes


def split_kind(config: PretrainedConfig, size: int) -> str | None:
    """How the target splits over ``size`` ranks: ``TENSOR`` (its heads, key/value heads and experts divide by it, and
    transformers has a tensor-parallel plan for it), ``EXPERTS`` (a MoE target whose experts divide by it but whose
    heads do not), or None (it cannot). A group of one is ``TENSOR`` (nothing split)."""
    if size == 1:
        return TENSOR
    text = text_config(config)
    sizes = _sizes(text)
    if getattr(text, "base_model_tp_plan", None) and all(n % size == 0 for n in sizes.values()):
        return TENSOR
    if num_experts(text) and getattr(text, "base_model_ep_plan", None) and num_experts(text) % size == 0:
        return EXPERTS
    return None


def group_sizes(config: PretrainedConfig, most: int) -> list[int]:
    """Every group size from 1 to ``most`` the target splits by."""
    return [k for k in range(1, most + 1) if split_kind(config, k) is not None]


def check_group_size(config: PretrainedConfig, size: int, where: str = "the target group size") -> str:
    """Refuse, before any weight is read, a group size the model cannot be split by: attention heads, KV heads and
    experts must divide by it (transformers would split a head across ranks), or for a MoE target at least its
    experts. Returns how it splits (``split_kind``)."""
    if size < 1:
        raise DraftlineError(f"{where} must be at least 1, got {size}")
    kind = split_kind(config, size)
    if kind is not None:
        return kind
    text = text_config(config)
    if not getattr(text, "base_model_tp_plan", None) and not num_experts(text):
        raise DraftlineError(
            f"{where} {size}: the target's model type {text.model_type!r} has no tensor-parallel plan in transformers "
            f"(base_model_tp_plan); run it with one GPU per target ({where} 1)."
        )
    sizes = _sizes(text)
    fits = [k for k in range(2, max(sizes.values()) + 1) if split_kind(config, k) is not None]
    listed = ", ".join(f"{n} {name}" for name, n in sizes.items())
    what = ("each must divide by the group size, so that every rank holds whole heads and whole experts (or, the "
            "attention whole on every rank, the experts at least)" if "experts" in sizes else
            "each must divide by the group size, so that every rank holds whole heads")
    raise DraftlineError(f"{where} {size}: the target has {listed}; {what}. Use {where} "
                         + (" or ".join(str(k) for k in fits) if fits else "1") + ".")


def _require_accelerate() -> None:
    # transformers' sharded loading places the weights through a device map, which needs accelerate.
    if importlib.util.find_spec("accelerate") is None:
        raise DraftlineError(
            "a target split over several ranks needs the `accelerate` package, which "
            "transformers' tensor-parallel loading uses: pip install accelerate"
        )


def group_mesh(group: dist.ProcessGroup, device_type: str):
    """transformers' mesh over the ranks of ``group`` only: tensor and expert parallel over the group, every other
    parallel dimension of size 1 (a group of this rank alone, made without involving any other rank)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    alone = dist.new_group([dist.get_rank()], backend=backend, use_local_synchronization=True)
    layout = torch.tensor(ranks, dtype=torch.int).view(1, 1, 1, len(ranks))
    groups = [alone, alone, alone, group]
    dense = DeviceMesh.from_group(groups, device_type, layout, mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = DeviceMesh.from_group(groups, device_type, layout, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return TransformersDeviceMesh(dense, expert)


def load_split(target_dir, config: PretrainedConfig, group: dist.ProcessGroup, *, device: torch.device,
               dtype: torch.dtype, attn_implementation: str):
    """The causal LM of ``target_dir`` (``config``, already cut to the layers that run) tensor-parallel over
    ``group``; every rank of the group must call this at the same time."""
    from transformers.distributed import DistributedConfig

    size = dist.get_world_size(group)
    kind = check_group_size(config, size)
    _require_accelerate()
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text = text_config(config)
    if getattr(model_class, "config_class", None) is type(text) and text is not config:
        config = text  # a vision-language checkpoint loads as its text model (as AutoModelForCausalLM does)
    mesh = group_mesh(group, device.type)

    class GroupModel(model_class):
        @classmethod
        def prepare_distribute_model(cls, distributed_config, device_map=None):
            return distributed_config, device, mesh

    GroupModel.__name__ = GroupModel.__qualname__ = model_class.__name__
    GroupModel.__module__ = model_class.__module__
    # Experts split over the same ranks: every rank routes the same tokens, one all-reduce sums their outputs. Split by
    # its experts alone, no tensor-parallel rule applies (an empty plan): the rest runs whole on every rank.
    parallel = DistributedConfig(tp_size=size, ep_size=size if num_experts(text) else None,
                                 tp_plan={} if kind == EXPERTS else None)
    return GroupModel.from_pretrained(target_dir, config=config, dtype=dtype, attn_implementation=attn_implementation,
                                      distributed_config=parallel)
