"""Speculative decoding over a prompt set, with the target-only baseline that wall-clock speedup needs.

Speedup is the ratio of time per generated token, target-only greedy over speculative, so prompts
that stop at different lengths (sampling) still compare. It is only meaningful on a GPU: both
sides are timed with synchronisation, after one untimed warm-up run of each (kernel selection,
allocator growth). On a CPU the Python overhead of tiny models dominates and nothing is timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel

from draftline.evaluate.acceptance import summarize_generations
from draftline.evaluate.sampling import Sampling
from draftline.evaluate.speculative import Generation, as_proposer, speculative_generate, target_generate, verified_rows


@dataclass
class EvalResult:
    summary: dict
    generations: list[Generation]
    baselines: list[Generation] = field(default_factory=list)

    def to_json(self) -> dict:
        """``OUT.json``: the summary, then ``per_prompt`` in prompt order."""
        per_prompt = []
        for i, g in enumerate(self.generations):
            entry = {"output_ids": g.output_ids, "acceptance_lengths": g.acceptance_lengths,
                     "num_prompt_tokens": g.num_prompt_tokens, "seconds": round(g.seconds, 6)}
            if g.confidences:
                entry["confidences"] = g.confidences
            if self.baselines:
                entry["baseline_seconds"] = round(self.baselines[i].seconds, 6)
            per_prompt.append(entry)
        return {**self.summary, "per_prompt": per_prompt}


def speed_summary(generations: Sequence[Generation], baselines: Sequence[Generation]) -> dict:
    """Time per token of both, their ratio, and how many outputs equal the baseline's."""
    spec_tokens = sum(g.num_generated for g in generations)
    base_tokens = sum(g.num_generated for g in baselines)
    spec_ms = 1e3 * sum(g.seconds for g in generations) / max(spec_tokens, 1)
    base_ms = 1e3 * sum(g.seconds for g in baselines) / max(base_tokens, 1)
    return {
        "speedup": base_ms / spec_ms if spec_ms > 0 else float("nan"),
        "ms_per_token": spec_ms,
        "baseline_ms_per_token": base_ms,
        "baseline_identical": sum(g.output_ids == b.output_ids for g, b in zip(generations, baselines)),
    }


def evaluate_prompts(
    target: PreTrainedModel,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    block_size: int | None = None,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    measure_speedup: bool | None = None,
    on_prompt: Callable[[int, Generation], None] | None = None,
) -> EvalResult:
    """Decode every prompt; ``measure_speedup`` (default: on CUDA) also runs target-only greedy. ``drafter``: a
    DFlash drafter or a drafter's proposer (``speculative.as_proposer``); ``block_size``: a DFlash drafter's block
    to draft (default its own)."""
    drafter = as_proposer(drafter, target)
    rows = int(block_size) if block_size is not None else verified_rows(drafter)
    drafted = {} if block_size is None else {"block_size": int(block_size)}  # a token proposer refuses one
    device = target.device
    if measure_speedup is None:
        measure_speedup = device.type == "cuda"
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    if measure_speedup and prompts:
        warm = dict(max_new_tokens=min(max_new_tokens, 2 * rows), stop_token_ids=stop_token_ids)
        speculative_generate(target, drafter, prompts[0], **warm, **drafted)
        target_generate(target, prompts[0], **warm)

    generations, baselines = [], []
    for i, prompt in enumerate(prompts):
        generation = speculative_generate(
            target, drafter, prompt, sampling=sampling, generator=generator, **common, **drafted
        )
        generations.append(generation)
        if measure_speedup:
            baselines.append(target_generate(target, prompt, **common))
        if on_prompt is not None:
            on_prompt(i, generation)

    summary = summarize_generations(generations, rows)
    summary.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                   max_new_tokens=max_new_tokens)
    if measure_speedup:
        summary.update(speed_summary(generations, baselines))
    return EvalResult(summary, generations, baselines)
