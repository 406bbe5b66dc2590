"""The monitor's tau is real acceptance: a tiny CPU training, then ``draftline eval`` on the same prompts.

The data is the target's own greedy continuations of the prompts, so the drafter learns to be
accepted there and tau moves well away from 1 (a drafter that is never accepted would make any
two measurements agree).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from draftline.cli import main
from draftline.data.dataset import DatasetWriter
from draftline.evaluate.speculative import target_generate
from line_helpers import base_args, read_jsonl

PROMPTS = [[17, 5, 230, 44, 91, 8], [3, 150, 150, 27, 260, 99], [201, 11, 64, 64, 7, 180], [40, 41, 42, 9, 300, 2]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def trained_run(qwen3_target, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("monitor_tau")
    model = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval()
    writer = DatasetWriter(root / "data", int(model.config.vocab_size))
    for prompt in PROMPTS:
        ids = target_generate(model, prompt, max_new_tokens=NEW_TOKENS).output_ids
        writer.add(np.array(ids), np.arange(len(ids)) >= len(prompt), [len(ids)])
    writer.finish({"target_vocab_size": int(model.config.vocab_size), "source": "tests"})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    out = root / "run"
    # During the run a cheap sample (1 prompt, 8 tokens); at the end what `draftline eval` measures below.
    args = base_args(qwen3_target, root / "data", out, epochs=40, lr="5e-3", max_anchors=32, save_every=1000,
                     eval_prompts=prompts, eval_num_prompts=1, eval_max_new_tokens=8,
                     eval_final_num_prompts=len(PROMPTS), eval_final_max_new_tokens=NEW_TOKENS)
    torch.set_num_threads(1)
    assert main(["train", *args]) == 0
    return out, prompts


def test_monitor_tau_matches_draftline_eval(trained_run, qwen3_target, tmp_path):
    out, prompts = trained_run
    records = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    end = [r for r in records if r["kind"] == "end"][-1]
    # On by default: about 10 measurements during the run, and one at the end.
    assert len(evals) >= 5 and evals[-1]["step"] == end["step"]
    # The final measurement uses the final settings, the ones before it the cheap sample.
    assert evals[-1]["final"] and evals[-1]["num_prompts"] == len(PROMPTS) and evals[-1]["max_new_tokens"] == NEW_TOKENS
    assert all(not e["final"] and e["num_prompts"] == 1 and e["max_new_tokens"] == 8 for e in evals[:-1])
    monitor_tau = evals[-1]["tau"]

    result = tmp_path / "eval.json"
    assert main(["eval", "--target", str(qwen3_target), "--drafter", str(out), "--prompts", str(prompts),
                 "--limit", str(len(PROMPTS)), "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu",
                 "--json", str(result)]) == 0
    eval_tau = json.loads(result.read_text())["tau"]
    assert eval_tau > 1.5, f"the drafter did not learn (tau {eval_tau:.2f}): the comparison would be empty"
    assert abs(monitor_tau - eval_tau) <= 0.10 * eval_tau, (monitor_tau, eval_tau)


def test_train_records_carry_the_measured_tau_not_the_teacher_forced_one(trained_run):
    out, _ = trained_run
    records = read_jsonl(out / "metrics.jsonl")
    measured = {r["step"]: r["tau"] for r in records if r["kind"] == "eval"}
    train = [r for r in records if r["kind"] == "train"]
    shown = [(r["tau_step"], r["tau"]) for r in train if r["tau"] is not None]
    assert shown, "no train record showed a measured tau"
    assert all(measured[step] == tau for step, tau in shown)
    assert all(r["tf_acceptance"] is None or 1.0 <= r["tf_acceptance"] <= 4.0 for r in train)
