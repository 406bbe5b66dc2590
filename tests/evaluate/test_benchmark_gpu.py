"""``draftline eval``'s wall-clock speedup on a GPU (``evaluate/benchmark.py``), on a tiny target.

Speedup is the target's own greedy decoding (one token per forward, KV cache, draftline's loop) over
speculative decoding, per generated token, both timed with synchronisation after a warm-up. Checked:
the figure is that ratio of the times it reports, the times are real (they fit in the wall clock
around the call), greedy speculative decoding gives the baseline's tokens, and a drafter the target
accepts more often gets the larger speedup.
"""

from __future__ import annotations

import time

import pytest
import torch

from draftline.checkpoint.export import load_drafter
from draftline.evaluate.benchmark import evaluate_prompts

pytestmark = pytest.mark.gpu


def _measure(target, drafter, prompts):
    began = time.perf_counter()
    result = evaluate_prompts(target, drafter, prompts, max_new_tokens=32, measure_speedup=True)
    return result, time.perf_counter() - began


def test_speedup_is_the_target_s_own_decoding_over_speculative(qwen3_target, trained_drafter, make_drafter):
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    target = AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).to(device).eval()
    trained_dir, prompts = trained_drafter  # it memorised the target's replies to these prompts
    trained = load_drafter(trained_dir, device=device, dtype=torch.float32).eval()
    untrained = make_drafter(qwen3_target, num_layers=2, block_size=8,
                             layer_types=["full_attention", "sliding_attention"], sliding_window=6).to(device)

    results = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        result, wall = _measure(target, drafter, prompts)
        s = result.summary
        spec_seconds = sum(g.seconds for g in result.generations)
        base_seconds = sum(g.seconds for g in result.baselines)
        assert 0 < spec_seconds + base_seconds <= wall  # measured times, not estimates
        spec_tokens = sum(g.num_generated for g in result.generations)
        base_tokens = sum(g.num_generated for g in result.baselines)
        assert s["ms_per_token"] == pytest.approx(1e3 * spec_seconds / spec_tokens)
        assert s["baseline_ms_per_token"] == pytest.approx(1e3 * base_seconds / base_tokens)
        assert s["speedup"] == pytest.approx(s["baseline_ms_per_token"] / s["ms_per_token"])
        assert s["baseline_identical"] == len(prompts)  # greedy speculative decoding is lossless
        results[name] = s
        print(f"{name}: tau {s['tau']:.2f}, {s['ms_per_token']:.2f} ms/token, baseline "
              f"{s['baseline_ms_per_token']:.2f} ms/token, speedup {s['speedup']:.2f}x")
    assert results["trained"]["tau"] > results["untrained"]["tau"] + 1
    assert results["trained"]["speedup"] > results["untrained"]["speedup"]
