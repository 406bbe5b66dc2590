"""SpecForge's own DFlash (or DSpark) training code, trained on draftline's batches, exported for the judge.

    pip install --no-deps --target .venv-x/site 'specforge==0.2.0'     # the `bench` extra, without its deps
    PYTHONPATH=.venv-x/site:src python bench/peer_objective.py --data DATA --target TARGET --out DIR \\
        --draft-layers 3 --block-size 8 --max-anchors 32 --max-batch-size 8 --epochs 2 --seed 0 \\
        [--peer-loss dpace | --peer-method dspark]

Nothing of the peer is re-implemented here: its draft model (``specforge.modeling.draft.dflash``),
its training wrapper and loss (``specforge.algorithms.common.dflash_family_model.OnlineDFlashModel``),
its draft-config generation from the target (``training.model_loading._generate_draft_config`` with
the DFlash provider's target-layer rule), its embedding/LM-head loader, its padding collator
(``algorithms.common.dflash_family_data.build_collator``) and its optimizer (``optimizer.BF16Optimizer``:
AdamW over fp32 masters of bf16 weights, its grad-norm clip and its warmup + cosine schedule) are
imported from the ``specforge`` package and called as its trainer calls them. No module is stubbed:
the DFlash path imports on a CPU as it is.

``--peer-method dspark`` trains its DSpark code instead: its draft model
(``specforge.modeling.draft.dspark.DSparkDraftModel``: the DFlash backbone, its Markov and confidence
heads), its training wrapper and loss (``OnlineDSparkModel``: 0.1 CE + 0.9 L1 + 1.0 BCE, its defaults)
and its collator (``build_dspark_collator``), built by its DSpark providers. SpecForge generates no
DSpark draft config from the target (it asks for ``model.draft_model_config``, as its shipped
``configs/*-dspark.json``): the script writes that file as a user would, from the config its DFlash
generator makes for the same target and layer count (same backbone, same target layers), with
``DSparkDraftModel`` as the architecture and the heads of draftline's DSpark defaults (Markov rank 256,
vanilla, confidence head on [h; Markov embedding]: also SpecForge's Qwen3.6-27B DSpark config's). The
target's final post-norm hidden state (its ``target_last_hidden_states``) comes from draftline's
``TargetFeatures(final_hidden=True)``. The trained drafter is exported as draftline's DSpark drafter (the
peer's tensor names are the export's), which ``bench/quality.py`` judges with draftline's DSpark proposer.

What this script supplies (and what therefore differs from a SpecForge run):

- the batches: draftline's batcher for the same flags as ``draftline train`` (same documents per
  batch, same order, same epochs), unpacked into the peer's padded rows, one conversation per row;
  SpecForge itself shuffles its rows uniformly (its batches mix lengths; draftline's batcher groups
  similar lengths inside windows);
- the target's features: draftline's ``TargetFeatures`` (fp32 on the CPU, the outputs of the same
  layers SpecForge captures: ``hidden_states[layer_id + 1]``), cast to the drafter's dtype; SpecForge
  captures them from SGLang in bf16;
- the attention backend: ``eager`` (its own masked path; its default ``flex_attention`` needs a GPU
  compile): same mask, same arithmetic up to rounding;
- the mask token: draftline's (the peer would fall back to the pad token on the tiny target, whose
  tokenizer names no mask token; ``--mask-token-id`` in its config does what we pass);
- anchors: the peer draws its own (``torch.rand`` per step, per row, uniform without replacement over
  the same eligible positions); ``--anchors ours`` hands it draftline's draw instead, so the two
  objectives see the very same blocks (an ablation of the draw, not of the distribution).

The trained drafter is written in the z-lab format (the peer's own tensor names) so that the
official ``dflash`` package and ``draftline eval`` load it unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import types
from pathlib import Path

import torch

DSPARK_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

def peer_config(args, mask_token_id: int):
    """The fields of SpecForge's run config that its DFlash builders read."""
    model = types.SimpleNamespace(
        target_model_path=str(args.target), cache_dir=None, trust_remote_code=False,
        draft_num_hidden_layers=args.draft_layers, draft_block_size=args.block_size,
        draft_model_config=None, draft_checkpoint_path=None, mask_token_id=mask_token_id,
        torch_dtype=args.peer_dtype, embedding_key=None, lm_head_key=None, use_liger_kernel=False)
    training = types.SimpleNamespace(
        strategy=args.peer_method, attention_backend="eager", num_anchors=args.max_anchors,
        loss_decay_gamma=args.peer_gamma, objective_chunk_blocks=128, loss_type=args.peer_loss, dpace_alpha=0.5,
        dspark_ce_loss_alpha=0.1, dspark_l1_loss_alpha=0.9, dspark_confidence_head_alpha=1.0,  # its schema's defaults
        learning_rate=args.lr, max_grad_norm=args.grad_clip, warmup_ratio=args.warmup_ratio,
        lr_scheduler="cosine", optimizer_cpu_offload=False)
    return types.SimpleNamespace(model=model, training=training, mode="offline")


def dspark_draft_config_file(args, cfg, heads: dict) -> Path:
    """The DSpark draft config a SpecForge user writes (its DSpark provider generates none): the config its
    DFlash generator makes for this target and layer count, as ``DSparkDraftModel`` with ``heads`` in its
    ``dflash_config``; written to OUT/peer-dspark-config.json."""
    from specforge.algorithms.dflash.providers import algorithm_providers as dflash_providers
    from specforge.training.model_loading import resolve_draft_config

    cfg.training.strategy = "dflash"
    try:
        dflash = resolve_draft_config(cfg, provider=dflash_providers().model.draft_config).to_dict()
    finally:
        cfg.training.strategy = "dspark"
    dflash["architectures"] = ["DSparkDraftModel"]
    dflash["dflash_config"] = {k: v for k, v in dflash.get("dflash_config", {}).items() if k != "projector_type"}
    dflash["dflash_config"].update(heads)
    dflash.pop("auto_map", None)
    path = args.out / "peer-dspark-config.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dflash, indent=1) + "\n")
    return path


def build_peer(args, mask_token_id: int, total_steps: int, heads: dict | None = None):
    """SpecForge's draft model, training wrapper and optimizer, built by its own functions (its DSpark ones
    with ``heads``: the DSpark heads' fields)."""
    if args.peer_method == "dspark":
        from specforge.algorithms.dspark.providers import algorithm_providers, build_draft, build_training_model
    else:
        from specforge.algorithms.dflash.providers import algorithm_providers, build_draft, build_training_model
    from specforge.training.model_loading import resolve_draft_config
    from transformers import AutoTokenizer

    cfg = peer_config(args, mask_token_id)
    if args.peer_method == "dspark":
        cfg.model.draft_model_config = str(dspark_draft_config_file(args, cfg, heads or {}))
    provider = algorithm_providers().model.draft_config
    draft_config = resolve_draft_config(cfg, provider=provider)
    torch.manual_seed(args.seed)  # the peer's init: HF normal(0, initializer_range), seeded like its trainer
    draft = build_draft(cfg, draft_config)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    parts = build_training_model(cfg, draft, draft_config, None, tokenizer)
    from specforge.optimizer import BF16Optimizer

    t = cfg.training
    optimizer = BF16Optimizer(parts.model.draft_model, lr=t.learning_rate, max_grad_norm=t.max_grad_norm,
                              warmup_ratio=t.warmup_ratio, lr_scheduler=t.lr_scheduler, total_steps=total_steps)
    return parts.model, optimizer, draft_config


def padded_rows(batch, features: torch.Tensor, dtype: torch.dtype, last_hidden: torch.Tensor | None = None) -> dict:
    """A packed draftline batch as the peer's collated rows: one document per row, zero-padded (with
    ``last_hidden``, the target's final hidden state per token: its DSpark collator's rows)."""
    from specforge.algorithms.common.dflash_family_data import build_collator, build_dspark_collator

    rows = []
    for start, length in zip(batch.doc_starts().tolist(), batch.doc_lengths.tolist()):
        rows.append({"input_ids": batch.input_ids[start:start + length].unsqueeze(0),
                     "loss_mask": batch.loss_mask[start:start + length].long().unsqueeze(0),
                     "hidden_states": features[start:start + length].to(dtype).unsqueeze(0)})
        if last_hidden is not None:
            rows[-1]["target_last_hidden_states"] = last_hidden[start:start + length].to(dtype).unsqueeze(0)
    return (build_collator() if last_hidden is None else build_dspark_collator())(rows)


def our_anchor_draw(model, batch, max_anchors: int, seed: int):
    """Patch the wrapper's anchor sampler to return draftline's draw for ``batch`` (same layout as its own)."""
    from draftline.objective.anchors import sample_anchors

    flat = sample_anchors(batch, max_anchors, seed)
    starts = batch.doc_starts()
    doc = torch.bucketize(flat, starts, right=True) - 1
    per_doc = [flat[doc == d] - starts[d] for d in range(batch.num_docs)]
    width = max(1, max(p.numel() for p in per_doc))

    def sample(seq_len, loss_mask, device):
        anchors = torch.zeros(len(per_doc), width, dtype=torch.long)
        keep = torch.zeros(len(per_doc), width, dtype=torch.bool)
        for i, p in enumerate(per_doc):
            anchors[i, : p.numel()] = p
            keep[i, : p.numel()] = True
        return anchors.to(device), keep.to(device)

    model._sample_anchor_positions = sample


def export(model, out: Path, args, drafter_cfg) -> Path:
    """The peer's trained weights (its bf16 model, as it ships them) in the z-lab format (DSpark: draftline's
    DSpark export, the same tensor names), fp32."""
    from draftline.checkpoint.export import save_drafter
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.dspark import DSparkDrafter

    ours = (DSparkDrafter if args.peer_method == "dspark" else DFlashDrafter)(drafter_cfg).float()
    state = {k: v.float() for k, v in model.draft_model.state_dict().items() if not k.startswith("rotary_emb.")}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"peer tensors do not map onto draftline's layout: missing {missing}, unexpected {unexpected}")
    return save_drafter(ours, out, dtype=torch.float32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, required=True, help="a dataset prepared by `draftline prepare`")
    p.add_argument("--target", type=Path, required=True, help="the target's directory (Hugging Face format)")
    p.add_argument("--out", type=Path, required=True, help="writes OUT/final (the drafter) and OUT/peer.json")
    p.add_argument("--draft-layers", type=int, default=3, help="drafter layers (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=8, help="block size (default: %(default)s)")
    p.add_argument("--max-anchors", type=int, default=32, help="the peer's num_anchors (per row = per conversation)")
    p.add_argument("--max-batch-size", type=int, default=8, help="conversations per step (the peer's batch_size)")
    p.add_argument("--token-budget", type=int, default=32768,
                   help="draftline's batcher budget, so that a batch holds --max-batch-size conversations (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default: %(default)s)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup-ratio", type=float, default=0.04, help="share of the steps in warm-up (default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="its gradient-norm clip (default: %(default)s)")
    p.add_argument("--peer-gamma", type=float, default=4.0,
                   help="its loss_decay_gamma; 4.0 = the paper's for block 8 (its configs set the paper's 7 for block 16)")
    p.add_argument("--peer-loss", default="dflash", choices=["dflash", "dpace"],
                   help="the peer's loss_type: its DFlash loss, or its D-PACE loss (alpha 0.5; divided by its per-rank "
                        "batch size, as its trainer does) (default: %(default)s)")
    p.add_argument("--peer-method", default="dflash", choices=["dflash", "dspark"],
                   help="the peer's training strategy: its DFlash code, or its DSpark code (its heads as draftline's "
                        "DSpark defaults; --peer-loss does not apply) (default: %(default)s)")
    p.add_argument("--peer-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="its model.torch_dtype (default bf16, as it trains; fp32 master weights either way)")
    p.add_argument("--anchors", default="peer", choices=["peer", "ours"],
                   help="peer: its own torch.rand draw; ours: draftline's seeded draw (the same blocks)")
    p.add_argument("--target-layer-ids", default=None, help="override the peer's rule (comma-separated)")
    p.add_argument("--seed", type=int, default=0, help="the batches' order and the peer's random init and draws")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (smoke tests); the schedule spans these steps")


def draftline_config(args):
    """The TrainConfig of the matching ``draftline train`` run (for its batches and drafter config)."""
    from draftline.config import TrainConfig

    config = TrainConfig()
    config.model.target = str(args.target)
    config.model.draft_layers = args.draft_layers
    config.model.block_size = args.block_size
    if args.target_layer_ids:
        config.model.target_layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
    config.data.data = [str(args.data)]
    config.data.token_budget = args.token_budget
    config.data.max_batch_size = args.max_batch_size
    config.data.max_anchors = args.max_anchors
    config.data.epochs = args.epochs
    config.data.seed = args.seed
    config.optim.max_steps = args.max_steps
    if args.peer_method == "dspark":
        config.model.method = "dspark"
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    if args.peer_method == "dspark" and args.peer_loss != "dflash":
        parser.error("--peer-loss applies to --peer-method dflash only (DSpark has its own loss)")

    from draftline.model.target import TargetFeatures
    from draftline.pipeline.spec import ModelSpec, plan_data

    torch.backends.cuda.matmul.allow_tf32 = False
    config = draftline_config(args)
    plan = plan_data(config, args.data, 1)
    ours_cfg = ModelSpec.resolve(config).drafter_config
    mask_id = int(ours_cfg.dflash_config["mask_token_id"])
    dspark = args.peer_method == "dspark"
    heads = {k: getattr(ours_cfg, k) for k in DSPARK_HEADS} if dspark else None
    model, optimizer, peer_cfg = build_peer(args, mask_id, plan.total_steps, heads)
    peer_layers = list(model.draft_model.target_layer_ids)
    if args.target_layer_ids:
        peer_layers = [int(x) for x in args.target_layer_ids.split(",")]
        model.draft_model.target_layer_ids = peer_layers
    if peer_layers != list(ours_cfg.dflash_config["target_layer_ids"]):
        raise RuntimeError(f"feature layers differ: peer {peer_layers}, draftline {ours_cfg.dflash_config['target_layer_ids']}")
    dtype = getattr(torch, args.peer_dtype)
    target = TargetFeatures(str(args.target), peer_layers, device=torch.device("cpu"), dtype=torch.float32,
                            attn_implementation="sdpa", final_hidden=dspark)
    width = len(peer_layers) * int(ours_cfg.hidden_size)
    torch.manual_seed(args.seed)  # the peer's anchor draws come from the global generator
    print(f"peer: {sum(p.numel() for p in model.draft_model.parameters()) / 1e6:.2f}M drafter parameters, "
          f"{plan.total_steps} steps, {args.peer_method}, layers {peer_layers}, gamma {args.peer_gamma}, {args.peer_dtype}, "
          f"anchors {args.anchors}", flush=True)
    model.train()
    start = time.time()
    log = []
    for seq in range(plan.end_seq):
        batch = plan.batch(seq)
        with torch.no_grad():
            features = target(batch)
        rows = padded_rows(batch, features[:, :width], dtype, features[:, width:] if dspark else None)
        if args.anchors == "ours":
            our_anchor_draw(model, batch, args.max_anchors, args.seed)
        extra = {"target_last_hidden_states": rows["target_last_hidden_states"]} if dspark else {}
        loss, accuracy, _ = model(input_ids=rows["input_ids"], hidden_states=rows["hidden_states"],
                                  loss_mask=rows["loss_mask"], **extra)
        loss.backward()
        grad_norm = optimizer.step()
        if seq % 50 == 0 or seq == plan.end_seq - 1:
            log.append({"step": seq, "loss": float(loss), "accuracy": float(accuracy), "grad_norm": float(grad_norm),
                        "lr": optimizer.get_learning_rate(), "s": time.time() - start})
            print(json.dumps(log[-1]), flush=True)
    train_s = time.time() - start
    final = export(model, args.out / "final", args, ours_cfg)
    summary = {"arm": "peer", "method": args.peer_method, "steps": plan.end_seq, "train_s": train_s, "drafter": str(final),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "log": log}
    (args.out / "peer.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"peer: trained {plan.end_seq} steps in {train_s:.0f}s; wrote {final}")


if __name__ == "__main__":
    main()
