"""Preflight: run each role's worst-case batch before training, refuse what would not fit.

A configuration that fits at step 1 can still run out of memory hours later: the largest batch
comes by chance, the optimizer state is allocated at the first step, a library update takes a few
hundred MB more. So before training each GPU role runs its worst case on synthetic data:

- target: ``token_budget`` tokens in one document through the layers it runs, plus the features
  that wait in its outbox;
- drafter: one pass of ``max_query_rows`` block rows over a ``token_budget``-token context,
  forward, backward and an optimizer step (AdamW state allocated), plus its receive buffers; in
  the colocated mode also the target's transient peak and the hidden-state queue.

If the peak plus ``memory_headroom_gib`` exceeds the device, the run is refused with the largest
token budget (or query rows) that fits, found by halving and bisecting with real runs.
"""

from __future__ import annotations

import torch

from draftline.data.batch import PackedBatch
from draftline.errors import DraftlineError

_GIB = 2**30


def _synthetic_batch(num_tokens: int, vocab_size: int) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=g)
    return PackedBatch(ids, torch.ones(num_tokens, dtype=torch.bool), torch.tensor([num_tokens]), torch.tensor([0]))


def _capacity(device: torch.device) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return total


def _measure(device: torch.device, fn) -> float | None:
    """Peak bytes allocated by ``fn`` (None if it ran out of memory)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        fn()
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return float(torch.cuda.max_memory_allocated(device))


def _largest_fitting(fits, upper: int, lower_bound: int) -> int | None:
    """Largest value in [lower_bound, upper) for which ``fits`` holds (halving, then 4 bisection steps)."""
    bad, good = upper, None
    value = upper // 2
    while value >= lower_bound:
        if fits(value):
            good = value
            break
        bad, value = value, value // 2
    if good is None:
        return None
    for _ in range(4):
        middle = (good + bad) // 2
        if middle in (good, bad):
            break
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def preflight_target(line, target) -> float:
    """Worst-case target batch; returns its transient peak (bytes above the resident model)."""
    config, device = line.config, line.device
    budget = config.data.token_budget
    width = target.feature_width
    outbox = max(1, -(-config.topology.q_hs // line.role.num_targets)) + 1
    vocab = target.embed_weight().shape[0]
    resident = float(torch.cuda.memory_allocated(device))

    def run(tokens: int):
        def body():
            queued = torch.empty(outbox * tokens, width, device=device, dtype=line.dtype)
            target(_synthetic_batch(tokens, vocab))
            del queued
        return _measure(device, body)

    limit = _capacity(device) - config.engine.memory_headroom_gib * _GIB
    peak = run(budget)
    if peak is None or peak > limit:
        best = _largest_fitting(lambda b: (p := run(b)) is not None and p <= limit, budget, 256)
        raise DraftlineError(
            f"preflight: the target ({line.health.info.describe()}) needs "
            f"{'more than the device has' if peak is None else f'{peak / _GIB:.1f} GiB'} at --token-budget {budget} "
            f"with q_hs {config.topology.q_hs} (limit {limit / _GIB:.1f} GiB incl. {config.engine.memory_headroom_gib} GiB headroom); "
            + (f"the largest budget that fits is {best}: pass --token-budget {best}" if best else
               "even small budgets do not fit: the target does not fit on this device")
        )
    print(f"draftline: preflight target: {peak / _GIB:.1f} GiB peak at --token-budget {budget} "
          f"(device {_capacity(device) / _GIB:.0f} GiB)")
    return peak - resident


def preflight_drafter(line, objective, optimizer, target=None) -> None:
    """Worst-case drafter pass + optimizer step (colocated: plus the target's transient peak)."""
    config, device = line.config, line.device
    drafter = objective.drafter
    block = drafter.block_size
    budget = config.data.token_budget
    width = line.feature_width
    colocated = target is not None
    extra = float(getattr(line, "target_preflight", 0.0)) if colocated else 0.0
    queued_batches = (config.topology.q_hs + 1) if colocated else 3  # queue (or receive prefetch) + the one in use
    vocab = objective.embed_weight.shape[0]
    saved = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}
    lrs = [group["lr"] for group in optimizer.param_groups]

    def run(tokens: int, query_rows: int) -> float | None:
        anchors_n = max(1, min(query_rows // block, tokens - block))
        batch = _synthetic_batch(tokens, vocab)
        anchors = torch.arange(tokens - anchors_n - 1, tokens - 1)  # late anchors: the most visible keys

        def body():
            from draftline.objective.blocks import build_blocks

            queued = torch.empty(queued_batches * tokens, width, device=device, dtype=line.dtype)
            features = torch.randn(tokens, width, device=device, dtype=line.dtype)
            blocks = build_blocks(batch, anchors, block_size=block, mask_token_id=objective.mask_token_id,
                                  gamma=objective.gamma).to(device)
            with torch.autocast(device.type, dtype=line.dtype, enabled=line.dtype != torch.float32):
                loss, _ = objective(features, blocks)
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            optimizer.step()  # allocates the AdamW state, changes nothing at lr 0
            optimizer.zero_grad(set_to_none=True)
            del queued, features

        peak = _measure(device, body)
        return None if peak is None else peak + extra

    limit = _capacity(device) - config.engine.memory_headroom_gib * _GIB
    rows = config.engine.max_query_rows
    try:
        peak = run(budget, rows)
        if peak is None or peak > limit:
            best_rows = _largest_fitting(lambda r: (p := run(budget, r)) is not None and p <= limit, rows, block)
            best_budget = _largest_fitting(lambda b: (p := run(b, rows)) is not None and p <= limit, budget, block * 2)
            needed = "more than the device has" if peak is None else f"{peak / _GIB:.1f} GiB"
            options = []
            if best_rows:
                options.append(f"--max-query-rows {best_rows}")
            if best_budget:
                options.append(f"--token-budget {best_budget}")
            options.append("--activation-checkpointing")
            raise DraftlineError(
                f"preflight: the drafter ({line.health.info.describe()}) needs {needed} for its worst case "
                f"(--token-budget {budget}, --max-query-rows {rows}{', colocated with the target' if colocated else ''}); "
                f"the limit is {limit / _GIB:.1f} GiB incl. {config.engine.memory_headroom_gib} GiB headroom. "
                f"What fits: {' or '.join(options)}"
            )
        print(f"draftline: preflight drafter: {peak / _GIB:.1f} GiB peak (worst case: {budget} context tokens, "
              f"{rows} query rows{', with the colocated target' if colocated else ''}; device {_capacity(device) / _GIB:.0f} GiB)")
    finally:
        with torch.no_grad():
            drafter.load_state_dict({k: v.to(device) for k, v in saved.items()})
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
