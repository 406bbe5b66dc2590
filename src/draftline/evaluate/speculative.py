"""DFlash speculative decoding with a Hugging Face target and our drafter, one prompt at a time.

One cycle (docs/OBJECTIVE.md, "Inference"), with ``x_s`` the last committed token (the anchor; it is
not yet in the target's KV cache) and ``B`` the block size::

    draft    drafter([x_s, MASK x (B-1)] | features of x_<s)        -> d_1 .. d_{B-1}
    verify   target([x_s, d_1 .. d_{B-1}]) at positions s .. s+B-1  -> p_1 .. p_B
    accept   a = the drafts the target agrees with (greedy) or keeps (rejection sampling),
             plus one token of its own: a + 1 tokens committed, the last one the next anchor
    commit   crop the target's cache back to x_<s+a+1; the features of x_s .. x_s+a are the
             drafter's new context (its cache holds context keys/values only, never a block).
             Linear-attention layers (hybrid targets): a transformers whose cache keeps their
             recurrent state after each verified row rewinds them in the crop; with an older one
             their states go back to before the block and x_s .. x_s+a run once more
             (``_LinearStates``)

A proposer that chooses its own tokens (``TokenProposer``: DSpark, whose Markov head picks the drafts slot by
slot) drafts ``num_drafts`` tokens from its block instead: B inputs ``[x_s, MASK x (B-1)]`` give ``d_1 .. d_B``,
verified as ``[x_s, d_1 .. d_B]``; the rest of the cycle is the same.

Prompt and output are laid out as the official ``dflash_generate`` lays them out: ``output_ids`` is
the prompt, the target's first token (from the prefill, not counted as a step), then each step's
committed tokens, cut at the first stop token (kept) or at ``max_new_tokens``.

Host syncs: one per step, reading the acceptance length and the committed tokens together; the
host needs them to size the next block and to look for stop tokens.

Prompts run one after another: the steps of different prompts accept different numbers of tokens,
so a batch would need ragged KV caches (or masking rejected rows instead of cropping them), which
Hugging Face caches of sliding-window and linear-attention targets do not support.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch.nn import functional as F
from transformers import DynamicCache, PreTrainedModel, cache_utils

from draftline.errors import DraftlineError
from draftline.evaluate.sampling import Sampling, choose, greedy_verify, probabilities, rejection_sample
from draftline.model.attention import BlockLayout, dense_mask
from draftline.model.config import mask_token_id
from draftline.model.drafter import ContextCache, DFlashDrafter


@dataclass
class Generation:
    """One prompt's decoding."""

    output_ids: list[int]
    """Prompt + generated tokens."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Tokens committed at each target verification step (speculative decoding only)."""
    num_prompt_tokens: int = 0
    seconds: float = 0.0
    """Wall-clock time of the whole decoding, prefill included (synchronised on CUDA)."""
    confidences: list[list[float] | None] = field(default_factory=list)
    """Per step, the proposer's predicted acceptance of each draft (a DSpark drafter's confidence head; None where
    it predicts none or drafted nothing), aligned with ``acceptance_lengths``; empty for a proposer without one."""

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) - self.num_prompt_tokens


class Proposer(Protocol):
    """What the decoding loop needs from a drafter (a seam for tests: an oracle proposer)."""

    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int

    def reset(self) -> None:
        """Forget the context: a new prompt starts."""

    def draft_logits(self, block_ids: torch.Tensor, anchor_pos: int, new_features: torch.Tensor) -> torch.Tensor:
        """Logits [S - 1, V] for slots 1.. of ``block_ids`` [S] (anchor at ``anchor_pos``, then masks).

        ``new_features`` [T, K * H] are the target features of the context rows not seen yet,
        positions ``anchor_pos - T .. anchor_pos - 1``.
        """


class TokenProposer(Protocol):
    """A drafter that picks its drafts itself (DSpark's Markov head reads each draft before the next)."""

    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    num_drafts: int
    """Tokens drafted per cycle at most (the verified block is one longer: the anchor first)."""

    def reset(self) -> None:
        """Forget the context: a new prompt starts."""

    def propose(self, anchor: torch.Tensor, anchor_pos: int, new_features: torch.Tensor, num_drafts: int,
                sampling: Sampling, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [num_drafts], the distributions they were drawn from [num_drafts, V] or None when greedy).

        ``anchor`` (a device scalar) is the last committed token, at ``anchor_pos``; ``new_features`` as for
        ``Proposer.draft_logits``. A proposer that predicts each draft's acceptance leaves it in
        ``last_confidence`` ([num_drafts] probabilities, or None), read after each call.
        """


class OneBlockAttention:
    """The drafter's attention at inference: one block whose anchor follows every context row.

    The visibility rule (``draftline.model.attention``) then lets full-attention layers see every
    key, so they run without a mask (fewer small ops per step, and SDPA may pick a fused kernel);
    sliding-window layers use the rule's dense mask, B x (context + B) booleans.
    """

    def __init__(self, config, anchor_pos: int, block_size: int, device: torch.device):
        self.layer_types = list(config.layer_types)
        self.scale = config.head_dim**-0.5
        self.sliding_mask = None
        if "sliding_attention" in self.layer_types:
            layout = BlockLayout(
                context_doc=torch.zeros(anchor_pos, dtype=torch.long, device=device),
                context_pos=torch.arange(anchor_pos, device=device),
                anchor_doc=torch.zeros(1, dtype=torch.long, device=device),
                anchor_pos=torch.full((1,), anchor_pos, dtype=torch.long, device=device),
                block_size=block_size,
            )
            self.sliding_mask = dense_mask(layout, sliding=True, window=config.sliding_window)[None, None]

    def __call__(self, q, k, v, layer_idx):
        mask = self.sliding_mask if self.layer_types[layer_idx] == "sliding_attention" else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])


class DFlashProposer:
    """Our drafter wired to the target: the target's embedding and LM head, a context-only cache."""

    def __init__(self, drafter: DFlashDrafter, target: PreTrainedModel):
        config = drafter.config
        dflash = config.dflash_config
        self.drafter = drafter
        self.config = config
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.mask_token_id = mask_token_id(config)
        self.block_size = drafter.block_size
        self.embed_weight = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        self.head_weight = head.weight if head is not None else self.embed_weight
        self.embed_scale = float(dflash.get("input_embedding_scale", 1.0))
        self.logit_multiplier = float(dflash.get("output_multiplier", 1.0))
        self.softcap = dflash.get("final_logit_softcapping")
        self.dtype = drafter.fc.weight.dtype
        self.cache = ContextCache()

    def reset(self) -> None:
        self.cache = ContextCache()

    def draft_logits(self, block_ids: torch.Tensor, anchor_pos: int, new_features: torch.Tensor) -> torch.Tensor:
        return self.head_logits(self.block_hidden(block_ids, anchor_pos, new_features)[1:])

    def block_hidden(self, block_ids: torch.Tensor, anchor_pos: int, new_features: torch.Tensor) -> torch.Tensor:
        """The drafter's final hidden states of the block ``block_ids`` [S] (anchor at ``anchor_pos``), [S, H];
        the new context rows enter its cache."""
        seen = self.cache.length()
        assert seen + new_features.shape[0] == anchor_pos, "the drafter's context must end right before the anchor"
        device = block_ids.device
        size = int(block_ids.shape[0])
        embeds = F.embedding(block_ids, self.embed_weight).to(self.dtype)
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        hidden = self.drafter(
            embeds,
            new_features.to(self.dtype),
            torch.arange(anchor_pos, anchor_pos + size, device=device),
            torch.arange(seen, anchor_pos, device=device),
            OneBlockAttention(self.config, anchor_pos, size, device),
            cache=self.cache,
        )
        return hidden

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafter hidden states [S, H] -> [S, V]."""
        logits = F.linear(hidden.to(self.head_weight.dtype), self.head_weight)
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# ---------------------------------------------------------------------------------------------
# The target's side: KV cache, features
# ---------------------------------------------------------------------------------------------


def _new_target_cache(target: PreTrainedModel, block_size: int) -> DynamicCache:
    """A cache that can be cropped back after a verification of ``block_size`` rows.

    Sliding-window and linear-attention layers must keep their past until the rejected rows are
    cropped. Where transformers can rewind a linear-attention layer itself (it then keeps the
    recurrent state after each of a verification's last rows), it is asked to keep ``block_size``.
    """
    cache = DynamicCache(config=target.config)
    if not hasattr(cache, "activate_past_recording"):
        return cache
    if rewinds_linear_attention():
        cache.activate_past_recording(recurrent_states_to_keep=block_size)
    else:
        cache.activate_past_recording()
    return cache


def rewinds_linear_attention() -> bool:
    """Whether this transformers' cache can crop a linear-attention layer's recurrent state."""
    layer = getattr(cache_utils, "LinearAttentionLayer", None)
    recording = getattr(layer, "activate_past_recording", None)
    return recording is not None and "recurrent_states_to_keep" in inspect.signature(recording).parameters


def _cache_arg(target: PreTrainedModel) -> str:
    # transformers renamed ``past_key_values`` to ``cache`` during 5.x; the old name still warns.
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions (rejected drafts go)."""
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(length - cache.get_seq_length())  # a count to drop (<= 0); crop(0) also trims sliding layers
    else:  # early transformers 5: the length to keep
        cache.crop(length)


class _LinearStates:
    """The recurrent and convolution states of a cache's linear-attention layers (Gated DeltaNet), kept
    from before a verification to go back to after it.

    ``crop`` cannot take rejected drafts out of these layers: transformers' cache keeps the convolution
    inputs of the block but only the recurrent state after its last row, which has the rejected rows
    folded in. Verification therefore starts from a copy; when drafts are rejected, the states are put
    back and the kept rows run once more, so the state holds exactly the committed tokens.
    """

    def __init__(self, cache: DynamicCache):
        rewinds = rewinds_linear_attention()
        self.layers = [layer for layer in getattr(cache, "layers", ())
                       if hasattr(layer, "recurrent_states") and not rewinds]
        self.saved: list | None = None

    def save(self) -> None:
        self.saved = [({i: _copy(t) for i, t in layer.recurrent_states.items()},
                       {i: _copy(t) for i, t in layer.conv_states.items()}) for layer in self.layers]

    def restore(self) -> None:
        for layer, (recurrent, conv) in zip(self.layers, self.saved):
            for i, state in recurrent.items():
                if state is not None:
                    layer.recurrent_states[i].copy_(state)  # in place: the layer keeps its tensor
            layer.conv_states.update(conv)


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Feature id l is the output of decoder layer l, HF ``hidden_states[l + 1]``; [T, K * H]."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # time what the GPU did, not what was queued
    return time.perf_counter()


def _check_lengths(input_ids: Sequence[int], max_new_tokens: int, block_size: int) -> None:
    if len(input_ids) == 0:
        raise DraftlineError("a prompt needs at least one token")
    if max_new_tokens < 1:
        raise DraftlineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size < 1:
        raise DraftlineError(f"block_size must be >= 1, got {block_size}")


def _first_stop(tokens: list[int], stop: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop), None)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter | Proposer | TokenProposer,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Decode one prompt with speculative decoding; lossless with respect to ``target``.

    ``drafter``: a proposer, or a DFlash drafter (``as_proposer``). ``block_size``: the DFlash block to draft
    (default the drafter's); a token proposer drafts with its own block only.
    """
    proposer = as_proposer(drafter, target)
    own_drafts = getattr(proposer, "num_drafts", None)  # a TokenProposer's
    if own_drafts is not None and block_size is not None and int(block_size) != proposer.block_size:
        raise DraftlineError(f"this drafter drafts from blocks of {proposer.block_size} (its training block); "
                             f"block_size={block_size} would change what every slot sees: drop the override")
    # The rows one verification holds: the anchor and the drafts.
    block_size = int(block_size or proposer.block_size) if own_drafts is None else int(own_drafts) + 1
    _check_lengths(input_ids, max_new_tokens, block_size)
    device = target.device
    stop = frozenset(int(t) for t in stop_token_ids)
    num_prompt = len(input_ids)
    max_length = num_prompt + max_new_tokens
    began = _now(device)

    proposer.reset()
    cache = _new_target_cache(target, block_size)
    cache_arg = _cache_arg(target)
    prefill = target(
        torch.tensor([list(input_ids)], device=device),
        **{cache_arg: cache},
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=True,
    )
    anchor = choose(prefill.logits[0, -1], sampling, generator)  # device scalar
    new_features = _features(prefill.hidden_states, proposer.target_layer_ids)
    tokens = list(input_ids) + [int(anchor)]
    start = num_prompt  # position of the anchor, the last committed token
    acceptance_lengths: list[int] = []
    confidences: list[torch.Tensor | None] = []  # a token proposer's predicted acceptance of each step's drafts
    stopped = tokens[-1] in stop
    linear = _LinearStates(cache)  # empty where the cache rewinds them itself

    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        block = torch.full((size,), proposer.mask_token_id, dtype=torch.long, device=device)
        block[0] = anchor
        if own_drafts is not None:
            confidences.append(None)
        if size > 1 and own_drafts is not None:
            block[1:], draft_probs = proposer.propose(anchor, start, new_features, size - 1, sampling, generator)
            confidences[-1] = getattr(proposer, "last_confidence", None)
        elif size > 1:
            draft_logits = proposer.draft_logits(block, start, new_features)  # [size - 1, V]
            if sampling.greedy:
                block[1:] = draft_logits.argmax(dim=-1)
            else:
                draft_probs = probabilities(draft_logits, sampling)
                block[1:] = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]

        if linear.layers:
            linear.save()
        verify = target(
            block[None],
            position_ids=torch.arange(start, start + size, device=device)[None],
            **{cache_arg: cache},
            use_cache=True,
            output_hidden_states=True,
        )
        drafts, target_logits = block[None, 1:], verify.logits[:, :size]
        if sampling.greedy:
            accepted, next_token = greedy_verify(drafts, target_logits)
        elif size > 1:
            target_probs = probabilities(target_logits, sampling)
            accepted, next_token = rejection_sample(drafts, target_probs, draft_probs[None], generator)
        else:
            accepted, next_token = torch.zeros(1, dtype=torch.long, device=device), choose(
                target_logits[:, 0], sampling, generator
            )

        # The one host sync of the step: the kept drafts followed by the target's own token.
        proposal = torch.cat([block[1:], next_token])
        proposal[accepted[0]] = next_token[0]
        num_accepted, *candidates = torch.cat([accepted, proposal]).tolist()
        committed = candidates[: min(num_accepted + 1, max_length - start - 1)]
        cut = _first_stop(committed, stop)
        if cut is not None:
            committed, stopped = committed[: cut + 1], True

        produced = len(committed)
        tokens.extend(committed)
        acceptance_lengths.append(produced)
        # Rows s .. s+produced-1 are committed and keep their cache and features; the last committed
        # token is the next anchor and enters the cache with the next block.
        new_features = _features(verify.hidden_states, proposer.target_layer_ids)[:produced]
        if linear.layers and produced < size:  # rejected rows are folded into the recurrent states
            _crop(cache, start)
            linear.restore()
            rerun = target(block[None, :produced], position_ids=torch.arange(start, start + produced, device=device)[None],
                           **{cache_arg: cache}, use_cache=True, output_hidden_states=True)
            new_features = _features(rerun.hidden_states, proposer.target_layer_ids)
        anchor = proposal[produced - 1]
        start += produced
        _crop(cache, start)

    # Read once the prompt is decoded (each read syncs with the device).
    predicted = [None if c is None else c.float().tolist() for c in confidences] if any(
        c is not None for c in confidences) else []
    return Generation(tokens[:max_length], acceptance_lengths, num_prompt, _now(device) - began, predicted)


def as_proposer(drafter, target: PreTrainedModel):
    """``drafter`` itself when it is a proposer; a DFlash drafter wired to ``target`` (``DFlashProposer``). A
    drafter of another method decodes through its method's proposer (``methods``), which the caller passes."""
    if not isinstance(drafter, torch.nn.Module):
        return drafter
    if getattr(drafter, "method", "dflash") != "dflash":
        raise DraftlineError(f"a {drafter.method} drafter drafts with its method's proposer: pass "
                             f"draftline.methods.method_for(drafter.config).proposer(drafter, target) instead of the "
                             "drafter")
    return DFlashProposer(drafter, target)


def verified_rows(proposer) -> int:
    """Rows of one verification at most: the anchor and the drafts (a ``TokenProposer`` drafts ``num_drafts``,
    a DFlash proposer ``block_size - 1``); acceptance lengths lie in 1 .. this."""
    own = getattr(proposer, "num_drafts", None)
    return int(own) + 1 if own is not None else int(proposer.block_size)


@torch.inference_mode()
def target_generate(
    target: PreTrainedModel,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Target-only decoding, one token per forward: the baseline for losslessness and speed."""
    _check_lengths(input_ids, max_new_tokens, 1)
    device = target.device
    stop = frozenset(int(t) for t in stop_token_ids)
    num_prompt = len(input_ids)
    began = _now(device)
    cache = {_cache_arg(target): DynamicCache(config=target.config)}
    logits = target(torch.tensor([list(input_ids)], device=device), **cache, use_cache=True, logits_to_keep=1).logits
    tokens = list(input_ids)
    while True:
        token = choose(logits[0, -1], sampling, generator)
        tokens.append(int(token))  # syncs: the stop check needs the token on the host
        if tokens[-1] in stop or len(tokens) - num_prompt >= max_new_tokens:
            break
        logits = target(token.view(1, 1), **cache, use_cache=True).logits
    return Generation(tokens, [], num_prompt, _now(device) - began)
