import hashlib
import time

import numpy as np
import pytest

from draftline.data.batcher import BatchSchedule, TokenBudgetBatcher
from draftline.errors import DraftlineError


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(np.log(300), 0.9, 5000).astype(np.int64), 4, 2048)


def test_budget_size_and_every_sample_once(lengths):
    batcher = TokenBudgetBatcher(lengths, token_budget=4096, max_batch_size=12, seed=3, sort_window=256)
    for epoch in range(3):
        batches = batcher.epoch_batches(epoch)
        assert all(lengths[b].sum() <= 4096 and 1 <= len(b) <= 12 for b in batches)
        everything = np.concatenate(batches)
        assert len(everything) == len(lengths) and np.array_equal(np.sort(everything), np.arange(len(lengths)))
    assert 0.5 < batcher.packing_efficiency(0) <= 1.0  # here max_batch_size binds more than the budget
    assert TokenBudgetBatcher(lengths, 4096, 64, seed=3).packing_efficiency(0) > 0.9


def test_deterministic_per_seed_and_epoch_and_different_across_epochs(lengths):
    make = lambda seed: TokenBudgetBatcher(lengths, 4096, 12, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    same = lambda x, y: len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))  # noqa: E731
    assert same(a.epoch_batches(1), b.epoch_batches(1))
    assert not same(a.epoch_batches(0), a.epoch_batches(1))
    assert not same(a.epoch_batches(0), c.epoch_batches(0))
    assert a.epoch_batches(0) is a.epoch_batches(0)  # cached


def test_sample_longer_than_the_budget_is_named(lengths):
    with pytest.raises(DraftlineError, match=r"sample 7 has 5000 tokens.*--max-length 4096"):
        TokenBudgetBatcher(np.r_[lengths[:7], 5000, lengths[7:]], 4096, 8)


def test_schedule_resume_and_consumers_match_the_uninterrupted_run(lengths):
    batcher = TokenBudgetBatcher(lengths, 4096, 12, seed=5)
    schedule = BatchSchedule(batcher, num_epochs=3)
    total = schedule.total_batches
    assert total == sum(batcher.num_batches(e) for e in range(3))
    run = [(s.seq, s.epoch, s.index_in_epoch, s.sample_indices.tolist()) for s in schedule.batches()]
    assert [r[0] for r in run] == list(range(total))
    assert run[-1][1:3] == (2, batcher.num_batches(2) - 1)
    for seq in (0, 1, batcher.num_batches(0) - 1, batcher.num_batches(0), total // 2, total - 1):
        assert schedule.locate(seq) == run[seq][1:3]
        assert schedule.sample_indices(seq).tolist() == run[seq][3]
        fresh = BatchSchedule(TokenBudgetBatcher(lengths, 4096, 12, seed=5), num_epochs=3)  # a restarted process
        assert [(s.seq, s.sample_indices.tolist()) for s in fresh.batches(start=seq)] == [(r[0], r[3]) for r in run[seq:]]
    with pytest.raises(IndexError):
        schedule.locate(total)
    # each epoch trains every sample exactly once across the whole schedule
    for epoch in range(3):
        seen = np.concatenate([np.asarray(r[3]) for r in run if r[1] == epoch])
        assert np.array_equal(np.sort(seen), np.arange(len(lengths)))
    for num_consumers in (1, 3, 4):
        start = 17
        shares = [[s.seq for s in schedule.batches(start, t, num_consumers)] for t in range(num_consumers)]
        flat = sorted(q for share in shares for q in share)
        assert flat == list(range(start, total))  # disjoint and complete
        assert all(q % num_consumers == t for t, share in enumerate(shares) for q in share)


def test_speed_one_million_samples_and_per_batch_host_time(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(2000), 0.8, 1_000_000).astype(np.int64), 16, 32768)
    started = time.perf_counter()
    batcher = TokenBudgetBatcher(lengths, 49152, 64, seed=0)
    batches = batcher.epoch_batches(0)
    build_s = time.perf_counter() - started
    assert build_s < 5.0, f"an epoch of 1M samples took {build_s:.2f} s"  # ~0.5 s on 2 loaded cores

    # host time per batch: sample indices + PackedBatch from the memory map, 49K-token budget
    from draftline.data.dataset import DatasetWriter, TokenDataset

    small = lengths[:4000]
    writer = DatasetWriter(tmp_path / "ds", vocab_size=151_936)
    writer.add(rng.integers(0, 151_936, int(small.sum())), rng.random(int(small.sum())) < 0.5, small)
    writer.finish({"target_vocab_size": 151_936})
    ds = TokenDataset(tmp_path / "ds")
    schedule = BatchSchedule(TokenBudgetBatcher(ds.lengths, 49152, 64, seed=0), num_epochs=1)
    schedule.total_batches
    started = time.perf_counter()
    for item in schedule.batches():
        ds.packed_batch(item.sample_indices, item.epoch, item.seq)
    per_batch_ms = (time.perf_counter() - started) / schedule.total_batches * 1e3
    assert per_batch_ms < 2.0, f"{per_batch_ms:.3f} ms per batch"  # loose: ~0.1 ms measured in bench/bench_data.py
    assert len(batches) > 0


def _step_imbalance(batcher: TokenBudgetBatcher, schedule: BatchSchedule, k: int, judge=None) -> float:
    """Mean over full steps of (largest / mean anchor count of the step's batches) - 1: the time a
    drafter with less work waits at the all-reduce, when each of k drafters takes one batch. The
    anchor counts are ``judge``'s (default: ``batcher``'s own)."""
    work = [(judge or batcher).anchors(s.sample_indices) for s in schedule.batches()]
    steps = [work[i : i + k] for i in range(0, len(work) - k + 1, k)]
    return float(np.mean([max(step) / np.mean(step) - 1 for step in steps]))


@pytest.mark.parametrize("k", [2, 4])
def test_a_steps_batches_have_similar_drafter_work(lengths, k):
    make = lambda step_batches: TokenBudgetBatcher(lengths, 4096, 64, seed=3, step_batches=step_batches,  # noqa: E731
                                                    max_anchors=64)
    plain, balanced = make(1), make(k)
    waits = [_step_imbalance(b, BatchSchedule(b, num_epochs=3), k) for b in (plain, balanced)]
    assert waits[0] > 0.15 and waits[1] < waits[0] / 5, waits  # measured: 0.39 -> 0.003 (k=2), 1.0 -> 0.01 (k=4)
    for epoch in range(3):  # the same batches, only reordered
        key = lambda batches: sorted(tuple(b.tolist()) for b in batches)  # noqa: E731
        assert key(plain.epoch_batches(epoch)) == key(balanced.epoch_batches(epoch))
    # the order is still a shuffle: the steps' work is not sorted through the epoch
    work = [balanced.anchors(b) for b in balanced.epoch_batches(0)]
    assert not (np.all(np.diff(work) >= 0) or np.all(np.diff(work) <= 0))


def test_balanced_groups_line_up_with_steps_across_epochs(lengths):
    """Epochs whose batch counts are not multiples of the step: groups still start at step boundaries."""
    k = 3
    batcher = TokenBudgetBatcher(lengths, 4096, 64, seed=4, step_batches=k, max_anchors=64)
    counts = [batcher.num_batches(e) for e in range(3)]
    assert any(c % k for c in counts)  # the case this test is about
    schedule = BatchSchedule(batcher, num_epochs=3)
    assert _step_imbalance(batcher, schedule, k) < 0.05
    fresh = BatchSchedule(TokenBudgetBatcher(lengths, 4096, 64, seed=4, step_batches=k, max_anchors=64), 3)
    start = counts[0] + 5  # a restarted process builds epoch 1 without having ordered epoch 0
    assert [s.sample_indices.tolist() for s in fresh.batches(start=start)] == \
        [s.sample_indices.tolist() for s in schedule.batches(start=start)]


def test_one_batch_per_step_keeps_the_plain_shuffle(lengths):
    """The order of runs started before balanced steps (a resume continues it): the digests are of the
    batcher as it was before them (commit ac4b5c0), epochs 0 and 1; anchors play no part in it."""
    def digest(batches):
        flat = np.concatenate([np.r_[len(b)] for b in batches] + list(batches)).astype(np.int64)
        return hashlib.sha256(flat.tobytes()).hexdigest()[:16]

    for max_anchors in (512, 7):
        batcher = TokenBudgetBatcher(lengths, 4096, 64, seed=6, step_batches=1, max_anchors=max_anchors)
        assert [digest(batcher.epoch_batches(e)) for e in (0, 1)] == ["094832b0efd2e537", "64e68193d15fc34c"]


def test_work_comes_from_the_anchor_positions_when_given(lengths):
    """Equal lengths but different loss masks: only the anchor positions tell the batches' work apart."""
    rng = np.random.default_rng(1)
    same = np.full(2000, 200)
    positions = rng.integers(0, 200, size=2000)
    by_length = TokenBudgetBatcher(same, 4096, 64, seed=2, step_batches=2, max_anchors=150)
    by_anchors = TokenBudgetBatcher(same, 4096, 64, seed=2, step_batches=2, max_anchors=150, anchor_positions=positions)
    batch = by_anchors.epoch_batches(0)[0]
    assert by_anchors.anchors(batch) == int(np.minimum(positions[batch], 150).sum())
    assert by_length.anchors(batch) == 150 * len(batch)
    waits = [_step_imbalance(b, BatchSchedule(b, num_epochs=1), 2, judge=by_anchors) for b in (by_length, by_anchors)]
    assert waits[1] < 0.01 and waits[0] > 0.02, waits
    with pytest.raises(DraftlineError, match="anchor_positions has 3 entries for 2000 samples"):
        TokenBudgetBatcher(same, 4096, 64, anchor_positions=[1, 2, 3])
