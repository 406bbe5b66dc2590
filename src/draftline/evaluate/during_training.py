"""Acceptance during training: speculative decoding on held-out prompts with the drafter as it is.

When: every ``eval_interval`` steps (``monitor.eval_every``; default about 10 times a run) and once at
the end. During the run it measures the first ``eval_num_prompts`` prompts at
``eval_max_new_tokens`` (cheap, to follow training); the final measurement, the monitor's last tau,
measures what ``draftline eval`` would: ``eval_final_num_prompts`` (default: all of the set) at
``eval_final_max_new_tokens`` (default 256, eval's).

Who: the first drafter decodes. Colocated it uses its target thread's own copy (kept with all its
layers, paused while it decodes); on a separate drafter rank a full copy of the target is loaded
once, on the first evaluation, beside the drafter: plan its memory when using ``--eval-every``.
Sharded, every drafter takes part in gathering the whole weights into the first drafter's copy,
and the others wait at a barrier while it decodes.

Memory: a measurement during the run that runs out of device memory turns the measurements during
the run off (every drafter learns it at the barrier), with a message; training goes on. The final
measurement still runs, and its failure is the run's.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from draftline.config import MonitorConfig
from draftline.distributed.shard import DrafterGroup
from draftline.model.drafter import DFlashDrafter


def eval_interval(eval_every: int | None, total_steps: int, evaluations: int = 10) -> int:
    """Steps between in-training measurements: ``eval_every``, or (None) about ``evaluations`` per
    run, so the monitor's measured tau follows training at a cost that does not grow with its length."""
    if eval_every is not None:
        if eval_every < 0:
            raise ValueError(f"monitor.eval_every (--eval-every) must be >= 0, got {eval_every}")
        return eval_every
    return max(1, total_steps // evaluations) if total_steps > 0 else 0


class InTrainingEvaluation:
    """Measures tau on the first drafter; prompts, the target copy and (sharded) the drafter copy are made on
    first use. Every drafter calls ``during`` and ``final`` at the same steps.

    ``config``: the monitor's section of the config (cadence, prompts, lengths); ``method``: the training method
    (``build_drafter`` for the sharded copy, ``proposer`` for decoding); ``target``: the target's
    directory; ``dataset``: the prepared dataset, whose held-out prompts are measured unless
    ``config.eval_prompts`` names a file; ``device``/``dtype``: where and in what the first drafter decodes;
    ``target_worker``: colocated, the target thread whose copy decodes (paused meanwhile); ``unavailable``: why
    nothing is measured in this run (a target split over a target group: no rank holds a copy that can decode)."""

    def __init__(self, config: MonitorConfig, *, total_steps: int, drafter_config, method, target: str, dataset,
                 device: torch.device, dtype: torch.dtype, group: DrafterGroup, logger, target_worker=None,
                 unavailable: str | None = None):
        self.config = config
        self.total_steps = total_steps
        self.drafter_config = drafter_config
        self.method = method  # the training method (draftline.methods): its drafter and its decoding step
        self.target = target
        self.dataset = dataset
        self.device, self.dtype = device, dtype
        self.group = group
        self.logger = logger
        self.target_worker = target_worker  # colocated: decode with its copy
        self.every = eval_interval(config.eval_every, total_steps)
        self.unavailable = unavailable
        """Why this run measures nothing (no copy of the target can decode beside the drafter), or None."""
        self.enabled = unavailable is None
        self._prompts: list[list[int]] | None = None  # every prompt either measurement uses
        self._target = None
        self._copy: DFlashDrafter | None = None  # sharded: the whole drafter, on the first drafter

    def due(self, step: int) -> bool:
        return self.enabled and bool(self.every) and step % self.every == 0 and step < self.total_steps

    def during(self, drafter, step: int) -> dict | None:
        """A measurement during the run; one that runs out of device memory turns the others off."""
        summary, out_of_memory = None, None
        try:
            summary = self._measure(drafter, step, final=False)
        except torch.OutOfMemoryError as exc:
            out_of_memory = exc
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self.group.several:  # every drafter learns whether the first one ran out
            stopped = self.group.agree_max(int(out_of_memory is not None))
        else:
            stopped = int(out_of_memory is not None)
        if stopped:
            self.enabled = False
            if out_of_memory is not None:
                print(f"draftline: in-training acceptance measurement turned off, it ran out of device memory "
                      f"({out_of_memory}); the monitor's tau stays n/a until the final measurement. Free memory "
                      "(smaller --token-budget, --colocated) or pass --eval-every 0 to measure only at the end",
                      flush=True)
        return summary

    def final(self, drafter, step: int) -> dict | None:
        """The end of the run's measurement, on the prompts and length ``draftline eval`` uses."""
        if self.unavailable is not None:
            return None
        summary = self._measure(drafter, step, final=True)
        if self.group.several:
            self.group.barrier()
        return summary

    def settings(self, final: bool) -> tuple[int | None, int]:
        """(prompts, new tokens per prompt) of a measurement during training or of the final one."""
        c = self.config
        if final:
            return c.eval_final_num_prompts, c.eval_final_max_new_tokens
        return c.eval_num_prompts, c.eval_max_new_tokens

    # ------------------------------------------------------------------ the first drafter's part
    def _measure(self, drafter, step: int, final: bool) -> dict | None:
        if self.group.sharded:
            weights = self.group.full_weights(drafter)  # every drafter gathers
            if not self.group.is_first:
                return None  # ``during`` and ``final`` wait for the first drafter at their agreement
            drafter = self._whole_copy(weights)
        if not self.group.is_first:
            return None
        if self._prompts is None:
            self._prompts = self._load_prompts()
        num_prompts, max_new_tokens = self.settings(final)
        prompts = self._prompts[:num_prompts]
        if not prompts:
            return None
        if self._target is None:
            self._target = self._load_target()
        from draftline.evaluate.acceptance import measure_acceptance, unwrap

        start = time.time()
        was_training = drafter.training
        drafter.eval()
        device, dtype = self.device, self.dtype
        pause = self.target_worker.paused() if self.target_worker is not None else nullcontext()
        try:
            with pause, torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                proposer = self.method.proposer(unwrap(drafter), self._target)
                summary = measure_acceptance(self._target, proposer, prompts, max_new_tokens=max_new_tokens)
        finally:
            drafter.train(was_training)
        summary.update(kind="eval", time=time.time(), step=step, seconds=time.time() - start, final=final,
                       max_new_tokens=max_new_tokens)
        self.logger.log(summary)
        print(f"draftline: step {step}: {'final ' if final else ''}acceptance tau {summary['tau']:.2f} on "
              f"{summary['num_prompts']} held-out prompts, {max_new_tokens} tokens each ({summary['seconds']:.1f} s)",
              flush=True)
        return summary

    def _whole_copy(self, weights: dict[str, torch.Tensor]) -> DFlashDrafter:
        """The first drafter's unsharded copy of the drafter, in the compute dtype, refreshed from ``weights``."""
        if self._copy is None:
            with torch.device("meta"):
                copy = self.method.build_drafter(self.drafter_config)
            self._copy = copy.to_empty(device=self.device).to(self.dtype).requires_grad_(False)
        self._copy.load_state_dict(weights)
        return self._copy

    def _load_prompts(self) -> list[list[int]]:
        c = self.config
        limit = None if c.eval_final_num_prompts is None else max(c.eval_num_prompts, c.eval_final_num_prompts)
        if c.eval_prompts:
            from draftline.evaluate.prompts import read_prompts

            return read_prompts(c.eval_prompts, self.target, limit=limit)
        held = [r["input_ids"] for r in self.dataset.heldout() if r.get("input_ids")]
        return held[:limit]

    def _load_target(self):
        if self.target_worker is not None:  # colocated: the same copy, all layers kept
            return self.target_worker.features.model
        from transformers import AutoModelForCausalLM  # a drafter rank: a full copy, once (bf16 on GPU)

        # Preflight did not count this copy: say so where an out-of-memory would follow.
        print(f"draftline: loading a full copy of the target on this drafter rank ({self.device}) to measure "
              "acceptance (--eval-every); colocated runs reuse the target's own copy", flush=True)
        return AutoModelForCausalLM.from_pretrained(
            self.target, dtype=self.dtype).to(self.device).eval().requires_grad_(False)
