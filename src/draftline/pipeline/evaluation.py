"""Acceptance during training: speculative decoding on held-out prompts with the drafter as it is.

During the run it measures the first ``eval_num_prompts`` prompts at ``eval_max_new_tokens`` (cheap,
to follow training); the final measurement, the monitor's last tau, measures what ``draftline eval``
would: ``eval_final_num_prompts`` (default: all of the set) at ``eval_final_max_new_tokens`` (default
256, eval's). On the demo a 4-prompt, 32-token sample read 0.89x of eval's 24 x 64 (README).

Which target decodes: colocated, the target thread's own copy (kept with all its layers, paused
while the drafter decodes); on a separate drafter rank a full copy of the target is loaded once,
on the first evaluation, beside the drafter: plan its memory when using ``--eval-every``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from draftline.config import TrainConfig


class InTrainingEvaluation:
    """Measures tau on the logging rank; prompts and the target copy are loaded on first use."""

    def __init__(self, config: TrainConfig, plan, device: torch.device, dtype: torch.dtype, logger,
                 target_worker=None):
        self.config = config
        self.plan = plan
        self.device = device
        self.dtype = dtype
        self.logger = logger
        self.target_worker = target_worker  # colocated: decode with its copy
        self._prompts: list[list[int]] | None = None  # every prompt either measurement uses
        self._target = None

    def _load_prompts(self) -> list[list[int]]:
        c = self.config.monitor
        limit = None if c.eval_final_num_prompts is None else max(c.eval_num_prompts, c.eval_final_num_prompts)
        if c.eval_prompts:
            from draftline.evaluate.prompts import read_prompts

            return read_prompts(c.eval_prompts, self.config.model.target, limit=limit)
        held = [r["input_ids"] for r in self.plan.dataset.heldout() if r.get("input_ids")]
        return held[:limit]

    def settings(self, final: bool) -> tuple[int | None, int]:
        """(prompts, new tokens per prompt) of a measurement during training or of the final one."""
        c = self.config.monitor
        if final:
            return c.eval_final_num_prompts, c.eval_final_max_new_tokens
        return c.eval_num_prompts, c.eval_max_new_tokens

    def _load_target(self):
        if self.target_worker is not None:  # colocated: the same copy, all layers kept
            return self.target_worker.features.model
        from transformers import AutoModelForCausalLM  # a drafter rank: a full copy, once (bf16 on GPU)

        # Preflight did not count this copy: say so where an out-of-memory would follow.
        print(f"draftline: loading a full copy of the target on this drafter rank ({self.device}) to measure "
              "acceptance (--eval-every); colocated runs reuse the target's own copy", flush=True)
        return AutoModelForCausalLM.from_pretrained(
            self.config.model.target, dtype=self.dtype).to(self.device).eval().requires_grad_(False)

    def __call__(self, drafter, step: int, final: bool = False) -> dict | None:
        from draftline.evaluate.acceptance import measure_acceptance

        if self._prompts is None:
            self._prompts = self._load_prompts()
        num_prompts, max_new_tokens = self.settings(final)
        prompts = self._prompts[:num_prompts]
        if not prompts:
            return None
        if self._target is None:
            self._target = self._load_target()
        start = time.time()
        was_training = drafter.training
        drafter.eval()
        pause = self.target_worker.paused() if self.target_worker is not None else nullcontext()
        try:
            with pause, torch.no_grad(), torch.autocast(self.device.type, dtype=self.dtype,
                                                        enabled=self.dtype != torch.float32):
                summary = measure_acceptance(self._target, drafter, prompts, max_new_tokens=max_new_tokens)
        finally:
            drafter.train(was_training)
        summary.update(kind="eval", time=time.time(), step=step, seconds=time.time() - start, final=final,
                       max_new_tokens=max_new_tokens)
        self.logger.log(summary)
        print(f"draftline: step {step}: {'final ' if final else ''}acceptance tau {summary['tau']:.2f} on "
              f"{summary['num_prompts']} held-out prompts, {max_new_tokens} tokens each ({summary['seconds']:.1f} s)",
              flush=True)
        return summary
