"""Target groups in the plan: what one rank of a group of K holds and computes, and what the group moves over the link.

A target too large for one GPU runs on K ranks (``--target-parallel K``, ``model/target_parallel.py``), split in one
of two ways by transformers' plans:

- ``TENSOR`` (heads, key/value heads and experts divide by K): every matmul's columns or rows split K ways, the
  embedding and LM head by vocabulary rows, the experts K ways. One rank's share is the model with each layer's
  weights and attention heads / K (a Gated DeltaNet layer's recurrence runs whole on every rank). Over the link, per
  forward: one all-reduce of [tokens, hidden] after the vocabulary-parallel embedding, and per layer two (after the
  attention's ``o_proj``, after the MLP's ``down_proj`` or the experts' sum); a Gated DeltaNet layer gathers its five
  projections' outputs instead of its first all-reduce.
- ``EXPERTS`` (a MoE target whose heads do not divide by K but whose experts do): each rank holds 1/K of the routed
  experts and the rest whole, runs the attention (and any dense layer) whole, and one all-reduce of
  [tokens, hidden] per MoE layer sums the experts' outputs.

``rank_shape`` is one rank's share as a ``TargetShape``, so the FLOP counter and the memory model
(``memory_estimate.target_memory``) read it as they read a whole target: FLOPs per GPU, weights, activations per rank.
The queued features sit on the group's sending rank (its outbox), the features being built on every rank.

The link: a ring all-reduce of S bytes over K ranks moves ``2 (K-1)/K S`` through each GPU's link, an all-gather
``(K-1)/K S``; at the link's NCCL bus bandwidth (``Hardware.link_gbs``) that is their time. transformers runs these
collectives between the layers' matmuls, so the plan adds their time to the group's compute (no overlap). The
link is named from its bandwidth: above PCIe 5 x16's 64 GB/s it is NVLink (H200, H100 SXM, B200: every pair of GPUs
through NVSwitch); else PCIe (the RTX PRO 6000 node: no NVLink between all pairs, the GPUs talk through PCIe
switches or the host).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftline.model.config import text_config
from draftline.model.target_parallel import EXPERTS, TENSOR, num_experts, split_kind
from draftline.sizing.shapes import LINEAR, LayerShape, TargetShape

PCIE5_GBS = 64.0
"""PCIe 5 x16's raw bandwidth per direction, GB/s: a GPU link faster than this is NVLink."""


def link_kind(link_gbs: float) -> str:
    """The interconnect a collective bandwidth implies (see the module docstring)."""
    return "NVLink" if link_gbs > PCIE5_GBS else "PCIe"


def _routed(layer: LayerShape, text) -> tuple[int, int]:
    """(routed expert weights a token runs, routed expert weights in memory) of a MoE layer; (0, 0) for a dense one."""
    if not layer.stored_mlp_params:
        return 0, 0
    experts, per_token = num_experts(text), int(text.num_experts_per_tok)
    expert = (layer.stored_mlp_params - layer.mlp_params) // (experts - per_token)
    return per_token * expert, experts * expert


def rank_shape(shape: TargetShape, config, k: int) -> TargetShape:
    """One rank's share of the target split over a group of ``k`` (``config``: the target's, which says how it
    splits); ``shape`` itself for k = 1."""
    if k == 1:
        return shape
    kind = split_kind(config, k)
    if kind is None:
        raise ValueError(f"the target cannot be split over {k} ranks")
    text = text_config(config)
    layers = []
    for layer in shape.layers:
        run, stored = _routed(layer, text)
        if kind == EXPERTS:
            share = dict(mlp_params=layer.mlp_params - run + run // k,
                         stored_mlp_params=layer.stored_mlp_params - stored + stored // k if stored else 0)
        else:
            mlp_stored = layer.stored_mlp_params // k if layer.stored_mlp_params else 0
            share = dict(mixer_params=layer.mixer_params // k, mlp_params=layer.mlp_params // k,
                         stored_mlp_params=mlp_stored)
            if layer.kind != LINEAR:  # attention heads split; a Gated DeltaNet's recurrence runs whole
                share.update(heads=layer.heads // k, kv_heads=max(1, layer.kv_heads // k))
        layers.append(dataclasses.replace(layer, **share))
    vocab = -(-shape.vocab_size // k) if kind == TENSOR else shape.vocab_size
    return dataclasses.replace(shape, vocab_size=vocab, layers=tuple(layers))


@dataclass(frozen=True)
class GroupTraffic:
    """What one rank of a group of ``k`` moves over the link per token of a feature pass."""

    k: int
    kind: str
    all_reduces: int
    """All-reduces of [tokens, hidden] per forward."""
    gathers: int
    """All-gathers per forward (a Gated DeltaNet layer's projections)."""
    bytes_per_token: float
    """Bytes through each GPU's link per token (ring all-reduce: 2 (K-1)/K of the tensor; all-gather (K-1)/K)."""

    def seconds_per_token(self, link_gbs: float) -> float:
        return self.bytes_per_token / (link_gbs * 1e9)

    def describe(self, hidden: int) -> str:
        what = f"{self.all_reduces} all-reduces of [tokens, {hidden}]"
        if self.gathers:
            what += f" and {self.gathers} all-gathers"
        how = ("heads, MLP columns and experts split" if self.kind == TENSOR else
               "experts split, attention and dense parts whole on every rank")
        return f"{what} per forward ({how}): {self.bytes_per_token / 1e6:.2f} MB per token through each GPU's link"


def group_traffic(shape: TargetShape, config, layers_run: int, k: int, bytes_per_value: int = 2) -> GroupTraffic:
    """The link traffic of a feature pass over ``layers_run`` layers on a group of ``k`` (nothing for k = 1)."""
    if k == 1:
        return GroupTraffic(1, TENSOR, 0, 0, 0.0)
    kind = split_kind(config, k)
    hidden = shape.hidden_size
    ring = 2 * (k - 1) / k * bytes_per_value
    gather = (k - 1) / k * bytes_per_value
    all_reduces, gathers, values = 0, 0, 0.0
    for layer in shape.with_layers_run(layers_run).layers:
        moe = bool(layer.stored_mlp_params)
        if kind == EXPERTS:
            if moe:
                all_reduces += 1
                values += ring * hidden
            continue
        all_reduces += 1  # the MLP's (or the experts') sum
        values += ring * hidden
        if layer.kind == LINEAR:  # qkv, z, b, a and out projections gathered
            gathers += 5
            values += gather * (layer.conv_channels + layer.heads * layer.value_dim + 2 * layer.heads + hidden)
        else:
            all_reduces += 1  # after o_proj
            values += ring * hidden
    if kind == TENSOR:
        all_reduces += 1  # the vocabulary-parallel embedding
        values += ring * hidden
    return GroupTraffic(k, kind, all_reduces, gathers, values)
