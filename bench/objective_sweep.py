"""Objective variants on the demo's data, trained side by side, then measured by speculative decoding.

    python bench/objective_sweep.py --data DEMO/data --seed 0 --variants ours,peer,dense --out s0.json

One process trains every variant of one seed in lockstep on the same batches: the target's
features of a batch are computed once and handed to every variant's drafter (each with its own
optimizer), so a variant costs only its drafter's passes. Everything else is the demo's
``draftline train`` (its config, data schedule, drafter init, objective, AdamW and cosine schedule,
gradient normalised by the step's label weight, clipping), run in float32 as on the CPU. Then each
drafter is measured on the demo's held-out prompts exactly as ``draftline eval`` does (greedy
speculative decoding, same prompts and length).

Variants (a name maps to changes of the demo's settings):
  ours      the demo's defaults (init from the target's top layers, gamma 1.0, 16 anchors/doc)
  peer      a faithful reading of SpecForge's DFlash objective: random init, the paper's gamma (4.0
            for block 8), AdamW betas (0.9, 0.999), uniform anchors without replacement; the rest is
            the same rule (see README); its bf16 numerics are not reproduced (the CPU runs fp32)
  randinit / gamma4 / gamma2 / betas999 / nodecay: one change of ours
  dense     every eligible position anchors (no sampling)
  chained   anchors where inference starts blocks: a no-grad pass over every position gives the
            drafter's teacher-forced acceptance there, blocks are chained from each response start
  distill   soft labels, --distill 0.5
  fc1 / fc3 / fcavg: ours with ``fc`` started as the identity on feature layer 1 or 3 (zeros
            elsewhere) or on all three (their sum); ours (--init-from-target) starts it on the deepest
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import time
from pathlib import Path

import torch

import sys as _sys
_sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ modules

VARIANTS = {
    "ours": {},
    "peer": {"init_from_target": False, "gamma": 4.0, "betas": (0.9, 0.999)},
    "randinit": {"init_from_target": False},
    "gamma4": {"gamma": 4.0},
    "gamma2": {"gamma": 2.0},
    "betas999": {"betas": (0.9, 0.999)},
    "nodecay": {"gamma": 1e9},
    "dense": {"max_anchors": 4096},
    "chained": {"anchors": "chained", "max_anchors": 4096},
    "chained16": {"anchors": "chained"},
    "distill": {"distill": 0.5},
    "peer-dense": {"init_from_target": False, "gamma": 4.0, "betas": (0.9, 0.999), "max_anchors": 4096},
    "fc1": {"fc_init": (0,)},
    "fc3": {"fc_init": (1,)},
    "fcavg": {"fc_init": (0, 1, 2)},
}


def select_fc_(fc: torch.nn.Linear, blocks: tuple[int, ...]) -> None:
    """fc as the sum of the identity on the chosen feature blocks (K*H -> H), zeros elsewhere."""
    hidden = fc.weight.shape[0]
    with torch.no_grad():
        fc.weight.zero_()
        for i in blocks:
            fc.weight[:, i * hidden : (i + 1) * hidden] += torch.eye(hidden, device=fc.weight.device)


def _config(data: Path, seed: int, epochs: int | None, conversations_out: Path, train_flags: str = ""):
    from draftline.commands.train import add_arguments, config_from_args
    from draftline.demo.pipeline import DemoConfig, train_args

    cfg = DemoConfig(out=conversations_out)
    if epochs:
        cfg.epochs = epochs
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # extra `draftline train` flags after the demo's (a repeated flag overrides): e.g. bench/quality.py's BUDGET
    args = train_args(cfg, data, conversations_out / "unused")[1:] + ["--seed", str(seed)] + shlex.split(train_flags)
    return cfg, config_from_args(parser.parse_args(args))


class Variant:
    def __init__(self, name, config, device, embed, head, total_steps):
        from draftline.objective.loss import DFlashObjective, ObjectiveSettings
        from draftline.pipeline.build import build_drafter
        from draftline.pipeline.optim import build_optimizer, build_scheduler
        from draftline.pipeline.spec import ModelSpec, RunSpec

        change = VARIANTS[name]
        self.name = name
        config.model.init_from_target = change.get("init_from_target", True)
        self.drafter = build_drafter(RunSpec.standalone(config, ModelSpec.resolve(config), device))
        if "fc_init" in change:
            select_fc_(self.drafter.fc, change["fc_init"])
        settings = ObjectiveSettings(
            max_anchors=change.get("max_anchors", config.data.max_anchors),
            gamma=change.get("gamma", config.optim.loss_gamma), attention="dense",
            seed=config.data.seed, distill=change.get("distill", 0.0))
        self.objective = DFlashObjective(self.drafter, embed, head, settings)
        self.anchors = change.get("anchors", "uniform")
        optim = dataclasses.replace(config.optim, betas=change.get("betas", config.optim.betas))
        self.optimizer = build_optimizer(self.drafter, optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self.grad_clip = config.optim.grad_clip
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.tf = []  # teacher-forced acceptance (uniform blocks) of the last steps

    def _anchors(self, batch, features):
        from anchor_variants import chained_anchors
        from draftline.objective.anchors import eligible_anchors, sample_anchors
        from draftline.objective.blocks import build_blocks

        s = self.objective.settings
        if self.anchors == "uniform":
            return sample_anchors(batch, s.max_anchors, s.seed)
        every = eligible_anchors(batch)
        blocks = build_blocks(batch, every, block_size=self.objective.block_size,
                              mask_token_id=self.objective.mask_token_id, gamma=self.objective.gamma)
        blocks = blocks.to(features.device)
        with torch.no_grad():
            hidden = self.objective.hidden(features, blocks)[blocks.label_rows]
            hits = torch.zeros(every.numel() * blocks.block_size, device=features.device)
            hits[blocks.label_rows] = ((hidden @ self.objective.head_weight.t()).argmax(-1) == blocks.labels).float()
        hits = hits.view(-1, blocks.block_size)[:, 1:]
        accept = (1 + torch.cumprod(hits, 1).sum(1)).long().cpu()
        return chained_anchors(batch, accept, s.max_anchors, s.seed)

    def train_step(self, batch, features):
        from draftline.objective.blocks import build_blocks
        from draftline.objective.metrics import summarize

        o = self.objective
        if o.settings.distill <= 0 and features.shape[1] > o.drafter.fc.in_features:
            features = features[:, : o.drafter.fc.in_features]
        anchors = self._anchors(batch, features[:, : o.drafter.fc.in_features])
        blocks = build_blocks(batch, anchors, block_size=o.block_size, mask_token_id=o.mask_token_id,
                              gamma=o.gamma).to(features.device)
        loss_sum, metrics = o(features, blocks)
        loss_sum.backward()
        scale = 1.0 / float(metrics[1].clamp_min(1e-12))
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tf.append(metrics.detach())
        self.tf = self.tf[-50:]
        return summarize(torch.stack(self.tf).sum(0), o.block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="the demo's prepared dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="ours,peer")
    parser.add_argument("--epochs", type=int, default=None, help="default: the demo's")
    parser.add_argument("--train-flags", default="", help="`draftline train` flags applied after the demo's")
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-device", default="cpu",
                        help="where the drafters are measured (cpu: as the demo's `draftline eval`, and it keeps "
                             "a GPU shared by many sweep processes for training)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from draftline.demo.pipeline import HELDOUT_PROMPTS, TARGET
    from draftline.evaluate.acceptance import measure_acceptance
    from draftline.evaluate.prompts import read_prompts
    from draftline.model.target import TargetFeatures, load_embedding_and_head
    from draftline.pipeline.spec import ModelSpec, plan_data

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    names = args.variants.split(",")
    cfg, config = _config(args.data, args.seed, args.epochs, args.out.parent, args.train_flags)
    plan = plan_data(config, args.data, 1)
    layer_ids = list(ModelSpec.resolve(config).layer_ids)
    distill = any(VARIANTS[n].get("distill", 0) > 0 for n in names)
    target = TargetFeatures(TARGET, layer_ids, device=device, dtype=torch.float32, final_hidden=distill,
                            attn_implementation="sdpa")
    embed, head = load_embedding_and_head(TARGET, device=device, dtype=torch.float32)
    variants = [Variant(n, config, device, embed, head, plan.total_steps) for n in names]
    start = time.time()
    tf = {}
    assert plan.batches_per_step == 1, "the demo trains one batch per step"
    for seq in range(plan.end_seq):
        batch = plan.batch(seq)
        features = target(batch)
        for v in variants:
            tf[v.name] = v.train_step(batch, features)
        if seq % 100 == 0:
            print(f"seed {args.seed} step {seq}/{plan.end_seq} {time.time() - start:.0f}s "
                  + " ".join(f"{n}:{s['tf_acceptance']:.2f}" for n, s in tf.items()), flush=True)
    train_s = time.time() - start
    del target
    full = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="sdpa")
    full = full.to(args.eval_device).eval()
    prompts = read_prompts(str(HELDOUT_PROMPTS), str(TARGET), limit=args.eval_prompts)
    results = []
    for v in variants:
        v.drafter.to(args.eval_device).eval()
        with torch.no_grad():
            summary = measure_acceptance(full, v.drafter, prompts, max_new_tokens=args.eval_max_new_tokens)
            # the sample the demo's monitor measures during its run (its final measurement is eval's: tau)
            monitor = measure_acceptance(full, v.drafter, prompts[: config.monitor.eval_num_prompts],
                                         max_new_tokens=config.monitor.eval_max_new_tokens)
        row = {"variant": v.name, "seed": args.seed, "tau": summary["tau"], "monitor_tau": monitor["tau"],
               "p": summary["acceptance_by_position"][:4], "tf_acceptance": tf[v.name]["tf_acceptance"],
               "train_acc": tf[v.name]["accuracy_by_position"][:4], "steps": plan.end_seq,
               "train_s": train_s, "change": {k: (None if isinstance(x, float) and not math.isfinite(x) else x)
                                              for k, x in VARIANTS[v.name].items()}}
        print(json.dumps(row), flush=True)
        results.append(row)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
