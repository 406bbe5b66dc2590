"""Acceptance length against the peer's own code, at the peer's budget, on two corpora; the official judge.

    pip install --no-deps --target .venv-x/site specforge==0.2.0     # the `bench` extra, without its deps
    PY="nice -n 10 env PYTHONPATH=.venv-x/site:src OMP_NUM_THREADS=1 .venv/bin/python"
    $PY bench/quality.py data --corpus demo --out Q/demo --conversations 640         # stages 1-3 of the demo
    $PY bench/quality.py data --corpus sitepkgs --out Q/sitepkgs --conversations 640
    $PY bench/quality.py run --corpus-dir Q/demo --arms peer,init,random --seeds 0,1,2 --eval-prompts 32
    $PY bench/quality.py run --corpus-dir Q/sitepkgs --arms peer,init,random --seeds 0,1,2 --eval-prompts 32
    $PY bench/quality.py table Q/demo Q/sitepkgs
    $PY bench/quality.py resample --from Q/demo --out Q/demo-t1 --temperature 1   # the replies sampled
    $PY bench/quality.py run --corpus-dir Q/demo-t1 --arms init --seeds 0 --temperature 1  # judged sampling

The tables and their reading: docs/benchmarks/2026-12-acceptance-vs-peer.md (there the demo corpus was
1,280 conversations regenerated, of which the first 640 were prepared again; each run takes 6-11 minutes
on one CPU thread).

Corpora (each: a target, its own regenerated training data, held-out prompts the training never sees):

- ``demo``: the demo's stages 1-3 (``demo.pipeline.make_data``): code-continuation chats from this
  machine's Python standard library, answered by the shipped tiny target; prompts: the shipped
  held-out prompts (files of the stdlib the target never trained on).
- ``sitepkgs``: the same kind of chats cut from OTHER installed packages' sources (networkx,
  matplotlib, jinja2, markdown, numpy, dateutil: no stdlib file, no file the target saw), answered by
  the same tiny target; prompts: chats from a hash-held-out tenth of those files.

Arms (``--arms``; ``NAME=FLAGS`` adds one: extra ``draftline train`` flags, or ``peer:FLAGS`` for the
peer script): every arm gets the peer's budget and settings, the flags of ``BUDGET``.

- ``peer``: SpecForge's own code (``bench/peer_objective.py``) on the same batches; ``peer-dpace``: the same
  with its D-PACE loss; ``peer-dspark``: its DSpark code (``--peer-method dspark``: its DSpark draft model,
  heads and loss; judged as draftline's DSpark arms are, below);
- ``init``: ``draftline train --init-from-target`` (train's defaults: the D-PACE loss); ``dflash``: the same
  with ``--loss dflash``; ``random``: ``draftline train --random-init``;
- a DSpark arm is one with ``--method dspark`` among its flags, e.g.
  ``--arm 'dspark=--init-from-target --method dspark'`` (its heads and loss by their own flags:
  ``--markov-rank``, ``--markov-head-type``, ``--no-confidence-head``, ``--dspark-loss-weights``; ``--loss dpace``: D-PACE weights on its terms).

The judge: the official ``dflash`` package's ``DFlashDraftModel.from_pretrained`` on each run's
exported drafter and its ``dflash_generate`` (greedy, block 8; ``--temperature T``: its rejection sampling at T,
seeded) on the held-out prompts with the
target in fp32 on the CPU; tau = mean committed tokens per target step over all prompts. The official
package decodes DFlash drafters only: a DSpark arm is judged by draftline's own decoding with its method's
proposer (``judge_own``: greedy, equal to a one-token-at-a-time oracle in tests/evaluate/test_dspark_decoding.py;
its block of B inputs drafts B tokens, so its lengths run to B + 1). Training
compute: the project's FLOP counter (``sizing/flops.py``) over the run's batches and the anchors
the run trains (target forward + drafter forward/backward), and the wall time of the training
command (shared CPU: compare within one table only).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The peer's budget and settings (issue 29): 2 epochs, 3 layers, 32 anchors, block 8, batch 8,
# lr 6e-4, warm-up 4%, cosine (draftline's only schedule), clip 1.0.
BUDGET = ["--draft-layers", "3", "--block-size", "8", "--max-anchors", "32", "--max-batch-size", "8",
          "--epochs", "2", "--lr", "6e-4", "--warmup-ratio", "0.04", "--grad-clip", "1.0"]
ARMS = {
    "peer": "peer:--peer-dtype float32",  # fp32 on the CPU (no bf16 units here: emulated bf16 is ~20x slower)
    "peer-dpace": "peer:--peer-dtype float32 --peer-loss dpace",
    "peer-dspark": "peer:--peer-dtype float32 --peer-method dspark",
    "init": "--init-from-target",  # train's defaults: the D-PACE loss since 2026-12-04
    "dflash": "--init-from-target --loss dflash",
    "random": "--random-init",
}
SITE_PACKAGES = ("networkx", "matplotlib", "jinja2", "markdown", "numpy", "dateutil")


# --------------------------------------------------------------------------------------------------
# Corpora


def sitepkgs_files(heldout_percent: int = 10) -> list[dict]:
    """Python sources of installed non-stdlib packages as the demo's corpus files (path, split, text)."""
    import sysconfig

    from draftline.demo.corpus import is_heldout

    root = Path(sysconfig.get_paths()["purelib"])
    files = []
    for package in SITE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "tests" in path.parts or "test" in path.parts or path.name.startswith("test_"):
                continue
            if path.stat().st_size > 200_000:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            files.append({"path": rel, "split": "heldout" if is_heldout(rel, heldout_percent) else "train",
                          "text": text})
    return files


def build_corpus(name: str, out: Path, conversations: int, seed: int = 0, prompts: int = 200) -> dict:
    """Stages 1-3 of the demo for corpus ``name``; writes OUT/corpus.json (target, data, prompts)."""
    import random

    from draftline.demo import pipeline
    from draftline.demo.corpus import CorpusConfig, add_docstrings, build_conversations

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = pipeline.DemoConfig(out=out, conversations=conversations, seed=seed)
    prompts_file = pipeline.HELDOUT_PROMPTS
    if name == "sitepkgs":
        files = sitepkgs_files()
        add_docstrings(files)
        corpus = CorpusConfig(prompt_lines=cfg.prompt_lines)
        train = build_conversations([f for f in files if f["split"] == "train"], corpus, seed=seed + 1)
        random.Random(seed).shuffle(train)
        # Held-out prompts: the tiny target's own prompt shape (10-30 lines), as its prompts.jsonl.
        held = build_conversations([f for f in files if f["split"] == "heldout"], CorpusConfig(), seed=seed + 12345)
        held = [c for c in held if len(c["messages"][0]["content"]) <= 1500]
        held = random.Random(seed).sample(held, min(prompts, len(held)))
        prompts_file = out / "prompts.jsonl"
        with open(prompts_file, "w", encoding="utf-8") as f:
            for i, conv in enumerate(held):
                f.write(json.dumps({"id": i, **conv}) + "\n")
        # make_data's stage 1 reads the demo's conversations; hand it these instead (stages 2-3 unchanged).
        pipeline._conversations = lambda _cfg: train[:conversations]
    elif name != "demo":
        raise SystemExit(f"unknown corpus {name!r}: demo or sitepkgs")
    start = time.time()
    data, _ = pipeline.make_data(cfg, out, pipeline.Stages())
    meta = {"corpus": name, "target": str(pipeline.TARGET), "data": str(data), "prompts": str(prompts_file),
            "conversations": conversations, "data_s": time.time() - start}
    (out / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def resample_corpus(source: Path, out: Path, temperature: float, seed: int = 0) -> dict:
    """A corpus of the same conversations and held-out prompts as ``source``, whose replies the target
    samples at ``temperature`` (``draftline regenerate --temperature``) instead of answering greedily."""
    from draftline.demo import pipeline

    src = json.loads((source / "corpus.json").read_text())
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = pipeline.DemoConfig(out=out)
    draftline = [sys.executable, "-m", "draftline"]
    replies = out / "regenerated.jsonl"
    start = time.time()
    subprocess.run([*draftline, "regenerate", "--target", src["target"], "--input", str(source / "conversations.jsonl"),
                    "--out", str(replies), "--max-new-tokens", str(cfg.max_new_tokens), "--batch-size", "32",
                    "--temperature", f"{temperature:g}", "--seed", str(seed)], check=True, cwd=REPO)
    subprocess.run([*draftline, "prepare", "--target", src["target"], "--input", str(replies), "--out", str(out / "data"),
                    "--max-length", str(cfg.token_budget), "--overwrite"], check=True, cwd=REPO)
    meta = {**src, "corpus": f"{src['corpus']}-t{temperature:g}", "data": str(out / "data"),
            "replies_temperature": temperature, "replies_seed": seed, "resampled_from": str(source.resolve()),
            "data_s": time.time() - start}
    (out / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------------------------------
# Training


def arm_spec(name: str, extra: dict[str, str]) -> tuple[str, list[str]]:
    """('peer' | 'train', extra flags) of an arm."""
    spec = extra.get(name, ARMS.get(name))
    if spec is None:
        raise SystemExit(f"unknown arm {name!r}; known: {sorted(ARMS)} (add one with NAME=FLAGS)")
    if spec.startswith("peer:"):
        return "peer", shlex.split(spec[5:])
    return "train", shlex.split(spec)


def train_command(kind: str, flags: list[str], corpus: dict, run_dir: Path, seed: int) -> list[str]:
    common = ["--target", corpus["target"], "--data", corpus["data"], "--seed", str(seed)]
    if kind == "peer":
        return [sys.executable, str(REPO / "bench" / "peer_objective.py"), *common, "--out", str(run_dir),
                *BUDGET, *flags]
    return [sys.executable, "-m", "draftline", "train", *common, "--out", str(run_dir), "--device", "cpu",
            "--from-scratch", "--no-tensorboard", "--log-every", "60", "--save-every", "0",
            "--save-every-minutes", "0", "--eval-every", "0", "--eval-prompts", corpus["prompts"],
            "--eval-final-num-prompts", "4", "--eval-final-max-new-tokens", "16", *BUDGET, *flags]


def train_arm(corpus_dir: Path, name: str, seed: int, extra: dict[str, str], force: bool = False) -> Path:
    corpus = json.loads((corpus_dir / "corpus.json").read_text())
    run_dir = corpus_dir / "runs" / f"{name}-s{seed}"
    done = run_dir / "train.json"
    if done.is_file() and not force:
        return run_dir
    kind, flags = arm_spec(name, extra)
    command = train_command(kind, flags, corpus, run_dir, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / ".venv-x" / "site"), str(REPO / "src"), env.get("PYTHONPATH", "")])
    print("$ " + shlex.join(command), flush=True)
    start = time.time()
    with open(run_dir / "log.txt", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {code}); see {run_dir / 'log.txt'}")
    record = {"arm": name, "seed": seed, "kind": kind, "flags": flags, "command": command,
              "wall_s": time.time() - start}
    done.write_text(json.dumps(record, indent=1) + "\n")
    return run_dir


# --------------------------------------------------------------------------------------------------
# Compute: the project's FLOP counter over the batches and anchors a run trains


def run_flops(corpus: dict, train: dict) -> dict:
    """Target and drafter FLOPs of a run's training, counted from its flags (same batches and anchor
    rule as the run: draftline's batcher and ``sample_anchors``; the peer's own draw has the same
    counts in expectation)."""
    import argparse as ap

    from draftline.commands.train import add_arguments, config_from_args
    from draftline.sizing.shapes import TargetShape
    from draftline.sizing.flops import drafter_flops_of_blocks, target_flops
    from draftline.objective.anchors import sample_anchors
    from draftline.objective.blocks import build_blocks
    from draftline.objective.dspark_blocks import build_dspark_blocks, default_dspark_gamma
    from draftline.pipeline.spec import ModelSpec, plan_data
    from draftline.model.config import default_loss_gamma
    from draftline.model.target import load_target_config

    flags = [f for f in train["flags"] if f != "--init-from-target"] if train["kind"] == "train" else []
    if train["kind"] == "peer" and "dspark" in train["flags"]:  # --peer-method dspark: count DSpark's work
        flags = ["--method", "dspark"]
    flags = [f for f in flags if not f.startswith("--anchors")]
    parser = ap.ArgumentParser()
    add_arguments(parser)
    args, _ = parser.parse_known_args(["--target", corpus["target"], "--data", corpus["data"], "--seed",
                                       str(train["seed"]), *BUDGET, *flags])
    config = config_from_args(args)
    plan = plan_data(config, Path(corpus["data"]), 1)
    model = ModelSpec.resolve(config)  # a DSpark arm's: its heads, teacher head and every target layer counted
    dcfg = model.drafter_config
    dshape = model.drafter_shape
    tshape = TargetShape.of(load_target_config(corpus["target"]))
    layers_run = model.layers_run
    dspark = model.method.name == "dspark"
    target = drafter = 0.0
    anchors = 0
    for seq in range(plan.end_seq):
        batch = plan.batch(seq)
        target += target_flops(tshape, batch.doc_lengths, layers_run)
        picked = sample_anchors(batch, config.data.max_anchors, config.data.seed)
        if dspark:  # its slots: the anchor's slot drafts too
            blocks = build_dspark_blocks(batch, picked, block_size=dcfg.block_size, mask_token_id=0,
                                         gamma=config.optim.loss_gamma or default_dspark_gamma(dcfg.block_size))
        else:
            blocks = build_blocks(batch, picked, block_size=dcfg.block_size, mask_token_id=0,
                                  gamma=config.optim.loss_gamma or default_loss_gamma(dcfg.block_size))
        drafter += drafter_flops_of_blocks(dshape, blocks)
        anchors += picked.numel()
    return {"target_flops": target, "drafter_flops": drafter, "flops": target + drafter, "anchors": anchors,
            "steps": plan.total_steps}


# --------------------------------------------------------------------------------------------------
# The judge: the official dflash package


def judge(corpus: dict, run_dir: Path, num_prompts: int, max_new_tokens: int, temperature: float = 0.0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from draftline.checkpoint.export import load_drafter_config
    from draftline.evaluate.acceptance import eos_token_ids, summarize
    from draftline.evaluate.prompts import read_prompts
    from draftline.methods import method_for

    if method_for(load_drafter_config(run_dir / "final")).name != "dflash":
        return judge_own(corpus, run_dir, num_prompts, max_new_tokens, temperature)
    from dflash import model as official

    official._cuda_time = time.perf_counter  # its return_stats times with cuda.synchronize
    target = AutoModelForCausalLM.from_pretrained(corpus["target"], dtype=torch.float32).eval()
    drafter = official.DFlashDraftModel.from_pretrained(str(run_dir / "final"), dtype=torch.float32).eval()
    prompts = read_prompts(corpus["prompts"], corpus["target"], limit=num_prompts)
    stop = eos_token_ids(target)
    lengths = []
    start = time.time()
    torch.manual_seed(0)  # its sampling draws from torch's global generator
    with torch.no_grad():
        for prompt in prompts:
            out = official.dflash_generate(drafter, target, torch.tensor([prompt]), max_new_tokens, stop,
                                           temperature=temperature, block_size=drafter.block_size, return_stats=True)
            lengths.append(list(out.acceptance_lengths))
    summary = summarize(lengths, drafter.block_size)
    summary.update({"judge": "dflash.model.dflash_generate", "max_new_tokens": max_new_tokens,
                    "temperature": temperature, "judge_s": time.time() - start})
    return summary


def judge_own(corpus: dict, run_dir: Path, num_prompts: int, max_new_tokens: int, temperature: float = 0.0) -> dict:
    """A drafter of another method than DFlash (DSpark), which the official dflash package cannot decode: its
    method's proposer in draftline's decoding (greedy, equal token for token to a one-token-at-a-time oracle:
    tests/evaluate/test_dspark_decoding.py; or rejection sampling at ``temperature``, seeded: on DFlash drafters it
    gives the official judge's tau to the last digit), on the same prompts, lengths and stop tokens as ``judge``."""
    import torch
    from transformers import AutoModelForCausalLM

    from draftline.checkpoint.export import load_drafter
    from draftline.evaluate.acceptance import eos_token_ids, measure_acceptance
    from draftline.evaluate.prompts import read_prompts
    from draftline.methods import method_for

    target = AutoModelForCausalLM.from_pretrained(corpus["target"], dtype=torch.float32).eval()
    drafter = load_drafter(run_dir / "final", dtype=torch.float32).eval()
    proposer = method_for(drafter.config).proposer(drafter, target)
    prompts = read_prompts(corpus["prompts"], corpus["target"], limit=num_prompts)
    start = time.time()
    with torch.no_grad():
        summary = measure_acceptance(target, proposer, prompts, max_new_tokens=max_new_tokens,
                                     temperature=temperature, stop_token_ids=eos_token_ids(target), seed=0)
    summary.update({"judge": f"draftline {method_for(drafter.config).name} proposer", "max_new_tokens": max_new_tokens,
                    "temperature": temperature, "judge_s": time.time() - start})
    return summary


def result_name(temperature: float) -> str:
    """Greedy judgements in result.json; sampled ones beside them, one file per temperature."""
    return "result.json" if temperature == 0 else f"result-t{temperature:g}.json"


def measure(corpus_dir: Path, run_dir: Path, num_prompts: int, max_new_tokens: int, force: bool = False,
            temperature: float = 0.0) -> dict:
    out = run_dir / result_name(temperature)
    if out.is_file() and not force:
        return json.loads(out.read_text())
    corpus = json.loads((corpus_dir / "corpus.json").read_text())
    train = json.loads((run_dir / "train.json").read_text())
    result = {**train, **judge(corpus, run_dir, num_prompts, max_new_tokens, temperature), **run_flops(corpus, train)}
    result.pop("command", None)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


# --------------------------------------------------------------------------------------------------
# Table


def table(corpus_dirs: list[Path], baseline: str = "peer", temperature: float = 0.0) -> str:
    lines = []
    for corpus_dir in corpus_dirs:
        corpus = json.loads((corpus_dir / "corpus.json").read_text())
        rows: dict[str, list[dict]] = {}
        for path in sorted((corpus_dir / "runs").glob(f"*/{result_name(temperature)}")):
            r = json.loads(path.read_text())
            rows.setdefault(r["arm"], []).append(r)
        if not rows:
            continue
        base = statistics.mean(r["tau"] for r in rows[baseline]) if baseline in rows else None
        lines += [f"**{corpus['corpus']}** ({corpus['conversations']} conversations; "
                  f"{rows[next(iter(rows))][0]['num_prompts']} held-out prompts x "
                  f"{rows[next(iter(rows))][0]['max_new_tokens']} tokens)", "",
                  f"| arm | tau, per seed | mean | spread (max - min) | vs {baseline} (per seed) | P(slot 1..3) | steps | TFLOP | (tau-1) per PFLOP | train s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for arm, rs in rows.items():
            rs.sort(key=lambda r: r["seed"])
            taus = [r["tau"] for r in rs]
            mean = statistics.mean(taus)
            p = [statistics.mean(r["acceptance_by_position"][k] for r in rs) for k in range(3)]
            flops = statistics.mean(r["flops"] for r in rs)
            per = (mean - 1) / (flops / 1e15)
            vs = f"{mean / base:.3f}x" if base else "-"
            if base and arm != baseline:  # same seed = same batches and order: the paired ratio per seed
                peer_tau = {r["seed"]: r["tau"] for r in rows[baseline]}
                paired = [f"{r['tau'] / peer_tau[r['seed']]:.2f}" for r in rs if r["seed"] in peer_tau]
                vs += f" ({', '.join(paired)})" if paired else ""
            lines.append(f"| {arm} | {', '.join(f'{t:.3f}' for t in taus)} (seeds {', '.join(str(r['seed']) for r in rs)}) "
                         f"| **{mean:.3f}** | {max(taus) - min(taus):.3f} | {vs} | {', '.join(f'{x:.2f}' for x in p)} "
                         f"| {rs[0]['steps']} | {flops / 1e12:.1f} | {per:.2f} | {statistics.mean(r['wall_s'] for r in rs):.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="make a corpus: conversations, the target's replies, the prepared dataset")
    d.add_argument("--corpus", required=True, choices=["demo", "sitepkgs"],
                   help="demo: chats from the Python standard library; sitepkgs: from other installed packages")
    d.add_argument("--out", type=Path, required=True, help="the corpus directory (corpus.json, data/, runs/)")
    d.add_argument("--conversations", type=int, default=1280, help="conversations to make (default: %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="seed of the conversations' cut and order")
    rs = sub.add_parser("resample", help="a corpus of another's conversations, the target's replies sampled")
    rs.add_argument("--from", dest="source", type=Path, required=True, help="a directory made by `data`")
    rs.add_argument("--out", type=Path, required=True, help="the new corpus directory")
    rs.add_argument("--temperature", type=float, required=True, help="the target's sampling temperature")
    rs.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    r = sub.add_parser("run", help="train each arm for each seed on a corpus, then judge it")
    r.add_argument("--corpus-dir", type=Path, required=True, help="a directory made by `data`")
    r.add_argument("--arms", default="peer,init,random", help="comma-separated arm names (default: %(default)s)")
    r.add_argument("--arm", action="append", default=[], help="NAME=FLAGS: define an arm (draftline train flags, "
                   "or peer:FLAGS for the peer script)")
    r.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; a seed fixes the batches (default: %(default)s)")
    r.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts the judge decodes (default: %(default)s)")
    r.add_argument("--eval-max-new-tokens", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    r.add_argument("--force", action="store_true", help="train and measure again")
    r.add_argument("--temperature", type=float, default=0.0, help="the judge's sampling temperature: 0 greedy; "
                   "above 0 rejection sampling, seeded, its results in result-tT.json beside the greedy ones "
                   "(default: %(default)s)")
    t = sub.add_parser("table", help="print one table per corpus from its runs' result.json (result-tT.json with --temperature)")
    t.add_argument("corpus_dirs", type=Path, nargs="+", help="corpus directories")
    t.add_argument("--temperature", type=float, default=0.0, help="whose judgements: the temperature of `run` "
                   "(default: %(default)s)")
    t.add_argument("--baseline", default="peer", help="the arm the others are divided by (default: %(default)s)")
    args = parser.parse_args()

    if args.cmd == "data":
        print(json.dumps(build_corpus(args.corpus, args.out, args.conversations, args.seed)))
    elif args.cmd == "resample":
        print(json.dumps(resample_corpus(args.source, args.out, args.temperature, args.seed)))
    elif args.cmd == "run":
        names = args.arms.split(",")
        extra = dict(item.partition("=")[::2] for item in args.arm)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name in names:
                run_dir = train_arm(args.corpus_dir, name, seed, extra, args.force)
                result = measure(args.corpus_dir, run_dir, args.eval_prompts, args.eval_max_new_tokens, args.force,
                                 args.temperature)
                print(json.dumps({k: result[k] for k in ("arm", "seed", "tau", "wall_s", "flops", "steps")}), flush=True)
    else:
        print(table(args.corpus_dirs, args.baseline, args.temperature))


if __name__ == "__main__":
    main()
