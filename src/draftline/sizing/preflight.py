"""Preflight: measure each role's peak memory before training, refuse what would not fit.

A configuration that fits at step 1 can still run out of memory hours later: the largest batch
comes by chance, the optimizer state is allocated at the first step, a library update takes a few
hundred MB more. So before training each GPU role checks its worst case on synthetic data:

- target: ``token_budget`` tokens through the layers it runs, plus the features that wait in its
  outbox;
- drafter: one pass of ``max_query_rows`` block rows over a ``token_budget``-token context,
  forward, backward and an optimizer step (AdamW state allocated), plus its receive buffers; in
  the colocated mode also the target's transient peak and the hidden-state queue.

Fast at any budget, because peak memory is linear in tokens and rows and compute need not be:

1. a warm-up pass at the smallest size, not measured: it compiles the kernels, creates the cuBLAS
   workspaces and (drafter) allocates the AdamW state, one-time allocations that later passes find
   resident and that a measured point would carry into the fit's slopes;
2. measure at two or three small sizes (seconds) and fit ``peak = a + b * tokens (+ c * rows)``;
3. check the fit at one more small size: if the measured peak is off the prediction by more than
   ``CHECK_TOLERANCE`` (a one-time allocation in a point, or a peak that is not linear), the fit is
   not trusted for a refusal;
4. if the trusted fit says the configuration does not fit, refuse at once with the largest token
   budget and query rows that do (from the fit, so no search by repeated full runs);
5. else verify once at the configured size (a pass that runs out of memory there is refused too).

The synthetic batches are the reference workload's worst case (``workload.worst_case_batch``): packed
documents of ``DOC_TOKENS`` tokens, every token trained. The measurements and their fit: ``peak_fit``.

The limit is what this process may really use: the device's memory times the allocator's
per-process fraction (``torch.cuda.set_per_process_memory_fraction``), and no more than is free now
plus what this process already holds, minus ``memory_headroom_gib``. Each start records the limit,
the peaks and the library versions in ``RUN_DIR/preflight/rank-N.json``; a resume says what changed.
"""

from __future__ import annotations

import json
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftline import run_files
from draftline.compile_clock import Took
from draftline.distributed.memory import MemoryLimit, find_out_of_memory, gib, memory_limit
from draftline.distributed.shard import local_tensor, replicates
from draftline.errors import DraftlineError
from draftline.sizing.memory_estimate import several_passes
from draftline.sizing.peak_fit import LinearPeak, check_point, fit_and_check, measured_sizes
from draftline.sizing.workload import worst_case_anchors, worst_case_batch

_GIB = 2**30
SMALL_TOKENS = 8192
"""The first measured size; the second is twice it. A budget up to 2x this is measured directly."""


def _say(message: str) -> None:
    print(f"draftline: preflight: {message}", flush=True)


# ---------------------------------------------------------------------------------------- measuring
def _measure(device: torch.device, fn) -> float | None:
    """Peak bytes allocated while ``fn`` runs (None if it ran out of memory)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        fn()
        torch.cuda.synchronize(device)
    except Exception as exc:
        if find_out_of_memory(exc) is None:  # an out-of-memory error, also one a compiler error wraps
            raise
        torch.cuda.empty_cache()
        return None
    return float(torch.cuda.max_memory_allocated(device))


@dataclass
class PreflightResult:
    """What a role's preflight measured: its peak at the configured size and every figure on the way
    (``measured``: the warm-up, the points, the fit, its check, the prediction, the verification)."""

    role: str
    peak: float
    measured: dict
    transient: "LinearPeak | None" = None
    """The target's: its peak above its resident weights, without its outbox, by tokens (a colocated drafter's
    preflight adds it)."""


# ---------------------------------------------------------------------------------------- target
def preflight_target(spec, target, who: str, group=None) -> PreflightResult:
    """Worst-case target batch of ``spec`` (a ``RunSpec``) on this rank (``who``: how messages name it).

    ``group``: this rank's target group (``distributed.target_group``). Its ranks run every measured pass together
    (the target's all-reduces) and take every decision from the group's largest peak (``TargetGroup.agree_peak``),
    so that they measure the same sizes and refuse together; only the group's sending rank holds the outbox."""
    config, device, dtype = spec.config, spec.device, spec.dtype
    started = time.perf_counter()
    budget = config.data.token_budget
    width = target.feature_width
    outbox = max(1, -(-spec.q_hs // spec.role.num_target_groups)) + 1
    if group is not None and not spec.colocated and not spec.role.sends:
        outbox = 0  # the group's first rank sends its features; the others hold none once a pass is over
    vocab = target.vocab_size
    resident = float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0
    limit = memory_limit(device, config.engine.memory_headroom_gib)
    measured: dict = {"model": model_prediction(spec, "target")}

    def warmed():  # what lies outside the allocator grew with the kernels loaded: the card's cap follows it
        nonlocal limit
        limit = memory_limit(device, config.engine.memory_headroom_gib)

    def run(tokens: int, _rows: int = 0, quiet: bool = False) -> float | None:
        def body():
            queued = torch.empty(outbox * tokens, width, device=device, dtype=dtype)
            target(worst_case_batch(tokens, vocab))
            del queued

        took = Took()
        peak = _measure(device, body)
        if group is not None:
            peak = group.agree_peak(peak)
        if not quiet:
            _say(f"target at {tokens:,} tokens: {'out of memory' if peak is None else gib(peak)} {took}")
        return peak

    sizes = measured_sizes(budget, SMALL_TOKENS, 256)
    check_at = check_point(sizes, [0], 1)
    _say(f"target ({who}): peak memory at {' and '.join(f'{s:,}' for s in sizes)} tokens"
         + (f" (checked at {check_at[0]:,}), extrapolated to --token-budget {budget:,}" if check_at else "")
         + f"; {limit.describe()}")
    fit, check, points = fit_and_check(measured, "target", run, [(size, 0) for size in sizes], check_at,
                                        lambda: _refuse_target(spec, budget, None, None, limit, who), _say, warmed)
    peak = points[0][2] if len(sizes) == 1 else None
    if peak is None:
        predicted = fit(budget)
        measured.update(predicted=predicted)
        if predicted > limit.limit and check.trusted:
            _refuse_target(spec, budget, predicted, fit, limit, who, predicted=True)
        _say(f"target: {gib(predicted)} predicted at {budget:,} tokens; verifying at that size")
        peak = run(budget)
        measured.update(verified=peak)
        if peak is not None:
            points.append((budget, 0, peak))
            fit = LinearPeak.fit(points)
    if peak is None or peak > limit.limit:
        _refuse_target(spec, budget, peak, fit, limit, who)
    # Colocated, the drafter adds this transient and counts the hidden-state queue itself: without the outbox. (Its
    # slope may be negative where the fit is one point, a constant: the transient is then exact at the budget and
    # larger than it is below it, on the safe side.)
    outbox_per_token = outbox * width * torch.finfo(dtype).bits // 8
    transient = LinearPeak(fit.base - resident, fit.per_token - outbox_per_token)
    seconds = time.perf_counter() - started
    _say(f"target: {gib(peak)} peak at --token-budget {budget:,}, within the {gib(limit.limit)} limit ({seconds:.1f} s)"
         + _beside_model(peak, measured["model"]))
    _record(spec, "target", {"token_budget": budget, "peak_bytes": peak, "seconds": seconds, "points": points,
                             "check": asdict(check) if check else None, "model": measured["model"], **asdict(limit)})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # from here on the peak is the training's (the monitor shows it)
    return PreflightResult("target", peak, measured, transient)


SUGGESTION_MARGIN = 0.01
"""The fraction of the limit that a refusal's suggested sizes leave free."""


def _suggestion_room(limit: MemoryLimit) -> float:
    """The peak a suggested size may reach: the limit less a margin, because the next run's limit moves
    with the device's free memory (seen on an H200: 137.1 GiB, then 136.7 GiB on the rerun, which
    refused a suggestion made at the edge)."""
    return limit.limit * (1 - SUGGESTION_MARGIN)


def _refuse_target(spec, budget, peak, fit, limit: MemoryLimit, who: str, predicted: bool = False):
    best = min(fit.largest_tokens(_suggestion_room(limit), 0, 256), budget - 256) if fit is not None else 0
    needed = "more than it may use (out of memory)" if peak is None else f"{gib(peak)}{' (predicted)' if predicted else ''}"
    raise DraftlineError(
        f"preflight: the target ({who}) needs {needed} at --token-budget {budget:,} with q_hs {spec.q_hs}; "
        f"{limit.describe()}. "
        + (f"The largest token budget that fits is about {best:,}: pass --token-budget {best}"
           + (", or lower --q-hs" if spec.q_hs > 1 else "") if best >= 256 else
           "Even small budgets do not fit: the target does not fit in the memory this process may use")
    )


# ---------------------------------------------------------------------------------------- drafter
def preflight_drafter(spec, worker, who: str, target_result: PreflightResult | None = None) -> PreflightResult:
    """Worst-case drafter pass + optimizer step of ``spec`` (a ``RunSpec``) with ``worker``'s drafter, objective
    and optimizer (colocated: plus the target's transient peak, ``target_result``). Weights and optimizer are
    left as they were; every drafter rank runs it (sharded: its passes gather and reduce like training's)."""
    config, device, dtype = spec.config, spec.device, spec.dtype
    objective, optimizer = worker.objective, worker.optimizer
    started = time.perf_counter()
    drafter = objective.drafter
    block = drafter.block_size
    budget = config.data.token_budget
    rows = config.engine.max_query_rows
    width = spec.model.feature_width
    colocated = spec.colocated
    extra = None
    if colocated:
        extra = target_result.transient if target_result is not None and target_result.transient else LinearPeak(0.0)
    # Feature batches alive besides the one being trained: colocated, the queue (the one the target is
    # producing is in the target's transient); else the receive prefetch.
    queued_batches = spec.queued_feature_batches
    vocab = objective.embed_weight.shape[0]
    limit = memory_limit(device, config.engine.memory_headroom_gib)
    measured: dict = {"model": model_prediction(spec, "drafter")}
    # A batch in several passes (or several batches a step): a later pass runs its forward beside the gradients of
    # the passes before it, so the worst case holds them (allocated before the pass, as the first backward would).
    held_gradients = several_passes(budget, rows, block) or spec.batches_per_step > spec.role.num_drafters
    params = [p for p in drafter.parameters()]
    saved = [local_tensor(p).detach().cpu().clone() for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]

    def run(tokens: int, query_rows: int, quiet: bool = False) -> float | None:
        anchors_n = max(1, min(query_rows // block, tokens - block - 1))
        batch = worst_case_batch(tokens, vocab)
        anchors = worst_case_anchors(tokens, anchors_n, block)

        def body():
            if held_gradients:
                for param in params:
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)
            queued = torch.empty(queued_batches * tokens, width, device=device, dtype=dtype)
            features = torch.randn(tokens, width, device=device, dtype=dtype)
            blocks = objective.build(batch, anchors).to(device)  # the method's blocks (DSpark: its slots)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, _ = objective(features, blocks)
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            optimizer.step()  # allocates the AdamW state, changes nothing at lr 0
            optimizer.zero_grad(set_to_none=True)
            del queued, features

        took = Took()
        peak = _measure(device, body)
        if peak is not None and extra is not None:
            peak += max(extra(tokens), 0.0)
        if quiet:
            return peak
        _say(f"drafter at {tokens:,} tokens x {anchors_n * block:,} query rows: "
             f"{'out of memory' if peak is None else gib(peak)}{' incl. the target' if colocated else ''} "
             f"{took}")
        return peak

    def warmed():  # what lies outside the allocator grew with the kernels loaded: the card's cap follows it
        nonlocal limit
        limit = memory_limit(device, config.engine.memory_headroom_gib)

    token_sizes = measured_sizes(budget, SMALL_TOKENS, 2 * block)
    chunk = max(config.engine.head_chunk_rows, block)
    row_sizes = measured_sizes(rows, chunk, block)  # from one head chunk up: the logits chunk is then its full size
    points_at = sorted({(token_sizes[0], row_sizes[0]), (token_sizes[-1], row_sizes[0]), (token_sizes[0], row_sizes[-1])})
    check_at = check_point(token_sizes, row_sizes, block)
    _say(f"drafter ({who}): peak memory of a pass with backward and optimizer step at "
         + ", ".join(f"{t:,} tokens x {r:,} rows" for t, r in points_at)
         + (f" (checked at {check_at[0]:,} x {check_at[1]:,}); extrapolated to --token-budget {budget:,} x "
            f"--max-query-rows {rows:,}" if check_at else "")
         + f"; {limit.describe()}")
    try:
        fit, check, points = fit_and_check(
            measured, "drafter", run, points_at, check_at,
            lambda: _refuse_drafter(spec, budget, rows, None, None, limit, who, colocated), _say, warmed)
        peak = points[0][2] if points_at == [(budget, rows)] else None
        if peak is None:
            predicted = fit(budget, rows)
            measured.update(predicted=predicted)
            if predicted > limit.limit and check.trusted:
                _refuse_drafter(spec, budget, rows, predicted, fit, limit, who, colocated, predicted=True)
            _say(f"drafter: {gib(predicted)} predicted at {budget:,} tokens x {rows:,} rows; verifying at that size")
            peak = run(budget, rows)
            measured.update(verified=peak)
            if peak is not None:
                points.append((budget, rows, peak))
                fit = LinearPeak.fit(points)
        if peak is None or peak > limit.limit:
            _refuse_drafter(spec, budget, rows, peak, fit, limit, who, colocated)
        seconds = time.perf_counter() - started
        _say(f"drafter: {gib(peak)} peak at --token-budget {budget:,}, --max-query-rows {rows:,}"
             f"{' with the colocated target' if colocated else ''}, within the {gib(limit.limit)} limit ({seconds:.1f} s)"
             + _beside_model(peak, measured["model"]))
        _record(spec, "drafter", {"token_budget": budget, "max_query_rows": rows, "peak_bytes": peak, "seconds": seconds,
                                  "points": points, "check": asdict(check) if check else None,
                                  "held_gradients": held_gradients, "model": measured["model"], **asdict(limit)})
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved):
                local_tensor(param).copy_(value)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()  # the moments and step counts preflight's step allocated: as new
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)  # from here on the peak is the training's
    return PreflightResult("drafter", peak, measured)


def _refuse_drafter(spec, budget, rows, peak, fit, limit: MemoryLimit, who, colocated, predicted=False):
    block = spec.model.block_size
    options = []
    q_hs = spec.q_hs
    if colocated and peak is not None:  # each queued batch of features: budget x width in the compute dtype
        per_batch = budget * spec.model.feature_width * torch.finfo(spec.dtype).bits // 8
        fewer = q_hs - int(-(-(peak - limit.limit) // per_batch))
        if 1 <= fewer < q_hs:
            options.append(f"--q-hs {fewer} (each queued batch of features is {gib(per_batch)})")
    if fit is not None:
        room = _suggestion_room(limit)
        best_rows = min(fit.largest_rows(room, budget, block), rows - block)
        best_budget = min(fit.largest_tokens(room, rows, 256), budget - 256)
        if best_rows >= block:
            options.append(f"--max-query-rows {best_rows} (at --token-budget {budget})")
        if best_budget >= 256:
            options.append(f"--token-budget {best_budget} (at --max-query-rows {rows})")
    options.append("--activation-checkpointing")
    needed = "more than it may use (out of memory)" if peak is None else f"{gib(peak)}{' (predicted)' if predicted else ''}"
    raise DraftlineError(
        f"preflight: the drafter ({who}) needs {needed} for its worst case (--token-budget {budget:,}, "
        f"--max-query-rows {rows:,}{', colocated with the target' if colocated else ''}); {limit.describe()}. "
        f"The largest that fit: {' or '.join(options)}"
    )


def suggested_flags(message: str) -> list[str]:
    """The flags a refusal names, the first fix: fewer query rows per pass (same budget, same work), else a
    smaller token budget, else fewer queued batches, else activation checkpointing; [] for another message."""
    # Suggested values are written without thousands separators; the configured ones ("32,768") with.
    for pattern, flag in ((r"--max-query-rows (\d+) \(at --token-budget", "--max-query-rows"),
                          (r"--token-budget (\d+)(?!,?\d)", "--token-budget"), (r"--q-hs (\d+)", "--q-hs")):
        found = re.search(pattern, message)
        if found:
            return [flag, found.group(1)]
    return ["--activation-checkpointing"] if "--activation-checkpointing" in message else []


# ---------------------------------------------------------------------------------------- the model beside it
def model_prediction(spec, role: str) -> dict | None:
    """What the memory model (``memory_estimate``) predicts for this rank's worst case of ``role`` ("target", or
    "drafter": colocated, with its target), by component: ``{"allocated_gib", "total_gib", "device_gib", "parts"}``;
    None where the model cannot say (a spec without the target's shape): a prediction is beside the measurement,
    never in its way."""
    try:
        return _model_prediction(spec, role)
    except Exception:  # noqa: BLE001 - the measurement decides; the model only stands beside it
        return None


def _model_prediction(spec, role: str) -> dict:
    from draftline.sizing.memory_estimate import (
        MemoryInputs, colocated_memory, drafter_memory, method_memory, target_memory,
    )

    config, model = spec.config, spec.model
    c, e, o = config.topology, config.engine, config.optim
    budget, rows = config.data.token_budget, e.max_query_rows
    num_feature_layers = len(model.layer_ids) + int(model.final_hidden)
    if role == "target":
        outbox = max(1, -(-spec.q_hs // spec.role.num_targets)) + 1
        keep_all = spec.colocated and spec.role.is_logging
        estimate = target_memory(model.target_shape, model.layers_run, budget, num_feature_layers, outbox,
                                 layers_kept=model.target_shape.num_layers if keep_all else None,
                                 num_gpus=spec.env.world_size, fp8=config.model.target_fp8)
    else:
        options = dict(recompute=e.recompute, moments=o.moments, head_chunk_rows=e.head_chunk_rows,
                       activation_checkpointing=e.activation_checkpointing)
        drafters = spec.role.num_drafters
        shards = 1 if replicates(c.drafter_state, spec.device) else drafters
        if spec.colocated:
            inputs = MemoryInputs(model.target_shape, model.drafter_shape, model.layers_run, num_feature_layers,
                                  spec.q_hs, target_fp8=config.model.target_fp8, **options)
            estimate = colocated_memory(inputs, drafters, budget, rows, num_shards=shards,
                                        keep_all_layers=spec.role.is_logging)
        else:
            estimate = drafter_memory(model.drafter_shape, budget, rows, spec.queued_feature_batches,
                                      num_shards=shards, num_gpus=spec.env.world_size, **options)
            estimate = estimate + method_memory(model.drafter_shape, budget, rows, spec.queued_feature_batches,
                                                num_shards=shards, head_chunk_rows=e.head_chunk_rows, moments=o.moments)
    return {"allocated_gib": round(estimate.allocated, 3), "total_gib": round(estimate.total, 3), "device_gib": round(estimate.device, 3),
            "parts": {name: round(value, 3) for name, (_, value) in estimate.parts.items()}}


def _beside_model(peak: float, model: dict | None) -> str:
    if model is None:
        return ""
    predicted = model["allocated_gib"] * _GIB
    return f"; the memory model said {gib(predicted)} ({(predicted - peak) / peak:+.1%})" if peak else ""


# ---------------------------------------------------------------------------------------- the record
def environment() -> dict:
    """What the memory a run needs depends on besides its config: libraries and the device."""
    import transformers

    record = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
              "cuda": torch.version.cuda}
    try:
        from importlib.metadata import version

        record["draftline"] = version("draftline")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        pass
    if torch.cuda.is_available():
        record["device"] = torch.cuda.get_device_name()
    return record


def changes(before: dict, now: dict) -> list[str]:
    """What differs between two records of a role: libraries, device, memory this process may use, peak."""
    out = []
    for key in ("torch", "transformers", "cuda", "python", "draftline", "device"):
        old, new = before.get("environment", {}).get(key), now.get("environment", {}).get(key)
        if old != new:
            out.append(f"{key} {old} -> {new}")
    for key, name in (("free", "free device memory"), ("fraction", "memory fraction"), ("peak_bytes", "measured peak")):
        old, new = before.get(key), now.get(key)
        if old is None or new is None:
            continue
        if key == "fraction":
            if abs(old - new) > 1e-6:
                out.append(f"{name} {old:.2f} -> {new:.2f}")
        elif abs(old - new) > 0.5 * _GIB:
            out.append(f"{name} {gib(old)} -> {gib(new)}")
    for key in ("token_budget", "max_query_rows"):
        if before.get(key) != now.get(key) and before.get(key) is not None:
            out.append(f"{key} {before.get(key)} -> {now.get(key)}")
    return out


def _record(spec, role: str, result: dict) -> None:
    """Write this start's figures to RUN_DIR/preflight/rank-N.json; on a resume, say what changed."""
    if not spec.config.out:
        return
    run_dir, rank = spec.run_dir, spec.env.rank
    path = Path(run_dir) / run_files.PREFLIGHT / run_files.rank_file(rank)
    result = {**result, "time": time.time(), "environment": environment()}
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = {}
    if role in previous:  # a resume (or a restart) of this run directory: what is not as it was
        changed = changes(previous[role], result)
        _say(f"{role}: since the previous start in {run_dir}: " + ("; ".join(changed) if changed else "nothing changed"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**previous, role: result}, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        print(f"draftline: preflight: could not write {path}: {exc}", file=sys.stderr)
