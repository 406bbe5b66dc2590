"""Data-path speed: prepare rate per core, batcher build time, host time per batch, packing.

    python bench/bench_data.py [--samples 300] [--workers 1]

The target is the tiny test target (its byte-level BPE has a 386-token vocabulary, so it cuts text
into more tokens than a real tokenizer would); conversations are sized to ~2.8K of its tokens,
the mean length of the seed pipeline's corpus. Per-batch host time is what a target or drafter
process pays to get a batch: schedule lookup + ``PackedBatch`` from the memory map, 49K budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chat_target import _WORDS, make_chat_target  # noqa: E402

from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher  # noqa: E402
from draftline.data.dataset import DatasetWriter, TokenDataset  # noqa: E402
from draftline.data.prepare import PrepareConfig, prepare  # noqa: E402

BUDGET = 49_152


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def write_corpus(path: Path, num_samples: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_samples):
            messages = [{"role": "system", "content": "You are helpful."}]
            for _ in range(3):  # ~1K tokens a turn pair with the tiny tokenizer
                messages.append({"role": "user", "content": _text(rng, 100)})
                messages.append({"role": "assistant", "content": _text(rng, rng.randint(250, 470))})
            f.write(json.dumps({"id": i, "messages": messages}) + "\n")


def bench_prepare(work: Path, num_samples: int, workers: int) -> dict:
    target = make_chat_target(work / "target")
    write_corpus(work / "corpus.jsonl", num_samples)
    started = time.perf_counter()
    meta = prepare(PrepareConfig(target=target, inputs=[str(work / "corpus.jsonl")], out=work / f"ds{workers}",
                                 workers=workers, progress=False, overwrite=True))
    seconds = time.perf_counter() - started
    return {"samples_s_core": meta["num_samples"] / seconds / workers, "tokens_s_core": meta["num_tokens"] / seconds / workers,
            "mean_len": meta["stats"]["mean_length"]}


def bench_batcher(num_samples: int = 1_000_000) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(2300), 0.6, num_samples), 16, 32768).astype(np.int64)
    started = time.perf_counter()
    batcher = TokenBudgetBatcher(lengths, BUDGET, max_batch_size=64, seed=0)
    batcher.epoch_batches(0)
    return {"epoch_build_s": time.perf_counter() - started, "efficiency": batcher.packing_efficiency(0),
            "mean_len": float(lengths.mean())}


def bench_host_time(work: Path, num_samples: int = 3000, vocab_size: int = 151_936) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(2300), 0.6, num_samples), 16, 32768).astype(np.int64)
    writer = DatasetWriter(work / "host_ds", vocab_size, overwrite=True)
    total = int(lengths.sum())
    writer.add(rng.integers(0, vocab_size, total), rng.random(total) < 0.5, lengths)
    writer.finish({"target_vocab_size": vocab_size})
    dataset = TokenDataset(work / "host_ds")
    schedule = BatchSchedule(TokenBudgetBatcher(dataset.lengths, BUDGET, 64, seed=0), num_epochs=2)
    num_batches = schedule.total_batches
    started = time.perf_counter()
    for seq in range(num_batches):
        epoch, _ = schedule.locate(seq)
        dataset.packed_batch(schedule.sample_indices(seq), epoch, seq)
    per_batch = (time.perf_counter() - started) / num_batches
    return {"us_per_batch": per_batch * 1e6, "batches_s": 1 / per_batch, "num_batches": num_batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300, help="conversations to prepare")
    parser.add_argument("--workers", type=int, default=1, help="prepare worker processes")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prep = bench_prepare(work, args.samples, args.workers)
        batch = bench_batcher()
        host = bench_host_time(work)
    at_2800 = prep["tokens_s_core"] / 2800
    rows = [
        ("prepare, samples/s per core", f"{prep['samples_s_core']:,.1f}", f"mean {prep['mean_len']:,.0f} tokens, {args.workers} worker(s)"),
        ("prepare, tokens/s per core", f"{prep['tokens_s_core']:,.0f}", f"= {at_2800:,.1f} samples/s per core at 2.8K tokens"),
        ("batcher, 1M-sample epoch", f"{batch['epoch_build_s']:.2f} s", f"mean {batch['mean_len']:,.0f} tokens, budget {BUDGET:,}"),
        ("packing efficiency", f"{100 * batch['efficiency']:.1f}%", "tokens / (batches x budget)"),
        ("host time per batch", f"{host['us_per_batch']:.0f} us", "schedule lookup + PackedBatch from the memmap"),
        ("batches/s (one process)", f"{host['batches_s']:,.0f}", f"{host['num_batches']} batches of <= {BUDGET:,} tokens"),
    ]
    print(f"machine: {os.cpu_count()} CPU cores")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>12}  {note}")


if __name__ == "__main__":
    main()
