"""Acceptance statistics of speculative decoding, and the measurement the training loop runs.

From the acceptance lengths of every target step (tokens committed per step, in ``1..B``):

- ``tau``: their mean, the paper's acceptance length (mean tokens committed per target step);
- ``acceptance_hist``: how many steps committed 1, 2, .., B tokens;
- ``acceptance_by_position``: for draft slot k = 1..B-1, P(slot k accepted) = the fraction of
  steps that committed at least k + 1 tokens. A prompt's last step may be cut short by the token
  limit or a stop token, which lowers these slightly on short generations;
- ``confidence_calibration`` (a DSpark drafter with a confidence head): per slot, the predicted and the
  realised acceptance of the steps that reached it.

B is the rows of a verification: the block for a DFlash drafter, the block + 1 for a DSpark one (its anchor's
slot drafts too, so lengths run to B + 1 of its block).

The dict has the fields of a ``kind: "eval"`` record of metrics.jsonl (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from draftline.errors import DraftlineError
from draftline.evaluate.sampling import Sampling
from draftline.evaluate.speculative import Generation, as_proposer, speculative_generate, verified_rows
from draftline.model.config import text_config
from draftline.model.linear_attention import PACKED_FLEX


def summarize(acceptance_lengths: Iterable[Sequence[int]], block_size: int) -> dict:
    """Summary of the per-prompt acceptance lengths (one list per prompt). ``block_size``: the rows one
    verification holds, the anchor and the drafts (``speculative.verified_rows``: B for a DFlash drafter of block
    B, B + 1 for a DSpark one, whose anchor slot drafts too)."""
    per_prompt = [list(lengths) for lengths in acceptance_lengths]
    lengths = [n for prompt in per_prompt for n in prompt]
    if any(not 1 <= n <= block_size for n in lengths):
        raise ValueError(f"acceptance lengths must lie in [1, {block_size}] (the block size)")
    hist = [0] * block_size
    for n in lengths:
        hist[n - 1] += 1
    num_steps = len(lengths)
    # Steps that committed at least k + 1 tokens accepted draft slot k.
    at_least = [sum(hist[k:]) for k in range(block_size)]
    return {
        "tau": sum(lengths) / num_steps if num_steps else 0.0,
        "acceptance_hist": hist,
        "acceptance_by_position": [at_least[k] / num_steps if num_steps else 0.0 for k in range(1, block_size)],
        "num_prompts": len(per_prompt),
        "num_steps": num_steps,
        "block_size": block_size,
    }


def summarize_generations(generations: Sequence[Generation], block_size: int) -> dict:
    """``summarize`` plus token totals, for results of ``speculative_generate``; with a proposer that predicts
    each draft's acceptance (DSpark's confidence head), its calibration (``confidence_calibration``)."""
    summary = summarize((g.acceptance_lengths for g in generations), block_size)
    summary["num_generated_tokens"] = sum(g.num_generated for g in generations)
    if any(g.confidences for g in generations):
        summary["confidence_calibration"] = confidence_calibration(generations, block_size - 1)
    return summary


def confidence_calibration(generations: Sequence[Generation], num_slots: int) -> dict:
    """Predicted against realised acceptance per draft slot (k = 1 .. ``num_slots``), from each step's predicted
    confidences and its acceptance length.

    The confidence head predicts a slot's acceptance given the drafts before it accepted (it is trained on the
    slot's own acceptance, teacher-forced). So slot k counts the steps that reached it (slots 1..k-1 accepted):
    ``predicted`` is their mean confidence, ``realised`` the share of them that accepted slot k, ``steps`` their
    number (NaN where none did). A step cut short by the token limit or a stop token reads as a rejection there.
    """
    sums, hits, counts = [0.0] * num_slots, [0] * num_slots, [0] * num_slots
    for g in generations:
        for predicted, length in zip(g.confidences, g.acceptance_lengths):
            if predicted is None:
                continue
            accepted = length - 1  # the step's last committed token is the target's own
            for k in range(min(len(predicted), accepted + 1, num_slots)):
                sums[k] += predicted[k]
                counts[k] += 1
                hits[k] += int(k < accepted)
    nan = float("nan")
    return {"predicted": [s / n if n else nan for s, n in zip(sums, counts)],
            "realised": [h / n if n else nan for h, n in zip(hits, counts)],
            "steps": counts}


def measure_acceptance(
    target_model: PreTrainedModel,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> dict:
    """Speculative decoding of ``prompts`` (token ids) and the summary of its acceptance.

    For the training loop: both models on one device, the drafter's weights as they are now (no
    gradients are kept). ``drafter``: a DFlash drafter, or the proposer of a drafter (its method's:
    ``speculative.as_proposer``). ``stop_token_ids`` defaults to the target's ``eos_token_id``. Sampling
    (``temperature > 0``) is seeded, so two calls on the same weights give the same numbers.
    """
    proposer = as_proposer(unwrap(drafter) if isinstance(drafter, torch.nn.Module) else drafter, target_model)
    if block_size is None:
        block_size = verified_rows(proposer)
        drafted = None  # the proposer's own block
    else:
        drafted = block_size = int(block_size)
    num_layers = int(text_config(target_model.config).num_hidden_layers)
    drafter = proposer.drafter
    if num_layers < int(drafter.config.num_target_layers):
        raise DraftlineError(
            f"the target model has {num_layers} of its {drafter.config.num_target_layers} layers (a feature-only "
            "copy?); decoding needs the whole model with its LM head (TargetFeatures(keep_all_layers=True))"
        )
    if stop_token_ids is None:
        stop_token_ids = eos_token_ids(target_model)
    sampling = Sampling(temperature=temperature)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=target_model.device).manual_seed(seed)
    with decoding_attention(target_model):
        generations = [
            speculative_generate(
                target_model,
                proposer,
                prompt,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                sampling=sampling,
                block_size=drafted,
                generator=generator,
            )
            for prompt in prompts
        ]
    return summarize_generations(generations, block_size)


@contextmanager
def decoding_attention(model: PreTrainedModel):
    """Run a target loaded with flex attention (the feature pass's choice on GPU: ``flex_attention``,
    or ``draftline_flex`` for hybrid targets) on SDPA meanwhile.

    Decoding changes the key length every step; flex attention would compile for each new shape.
    """
    current = getattr(model.config, "_attn_implementation", None)
    switch = current in ("flex_attention", PACKED_FLEX) and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(current)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DistributedDataParallel (``.module``) or torch.compile (``._orig_mod``)."""
    while True:
        inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    """The model's stop tokens: ``eos_token_id`` of its generation config, else of its config."""
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None) if config is not None else None
        if eos is not None:
            return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    return []


def format_summary(summary: dict, *, bar_width: int = 40) -> list[str]:
    """The summary as text lines: tau, the histogram as bars, acceptance by slot, speed if measured."""
    hist = summary["acceptance_hist"]
    steps = max(summary["num_steps"], 1)
    lines = [
        f"tau {summary['tau']:.3f}  (mean tokens committed per target step; block size {summary['block_size']}, "
        f"{summary['num_prompts']} prompts, {summary['num_steps']} steps"
        + (f", {summary['num_generated_tokens']} tokens)" if "num_generated_tokens" in summary else ")"),
        "tokens committed per step:",
    ]
    top = max(hist) if hist and max(hist) else 1
    for length, count in enumerate(hist, start=1):
        bar = "#" * round(bar_width * count / top)
        lines.append(f"  {length:>3} {bar:<{bar_width}} {count:>7}  {100 * count / steps:5.1f}%")
    by_slot = "  ".join(f"{k}:{p:.2f}" for k, p in enumerate(summary["acceptance_by_position"], start=1))
    lines.append(f"P(slot k accepted): {by_slot}")
    calibration = summary.get("confidence_calibration")
    if calibration is not None:
        pairs = "  ".join(f"{k}:{p:.2f}/{r:.2f}" for k, (p, r) in
                          enumerate(zip(calibration["predicted"], calibration["realised"]), start=1) if r == r)
        lines.append(f"confidence head, predicted/realised acceptance of slot k once reached: {pairs}")
    if "speedup" in summary:
        lines.append(
            f"speedup {summary['speedup']:.2f}x over target-only greedy "
            f"({summary['baseline_ms_per_token']:.2f} -> {summary['ms_per_token']:.2f} ms/token); "
            f"{summary['baseline_identical']}/{summary['num_prompts']} outputs identical to it"
        )
    return lines
