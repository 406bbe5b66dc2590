"""The memory model (draftline.sizing.memory_estimate) against one GPU: the roles' worst cases and the colocated
line at the 8B and 27B shapes, allocated and device peaks beside the model's, with the error.

    python bench/memory_model.py --json memory_model.json        # one H200: 8b and 27b-hybrid, ~6 minutes
    python bench/memory_model.py --device cpu --sizes tiny=2048x512,tiny-hybrid=2048x512 --line-steps 1
                                                                  # a check that it runs (CPU: no memory figures)

Per shape, in this order, in one process (random bf16 weights built from the shape's config; the drafter is the
product's default for it, built by the product's builder, compiled with --recompute's mode on CUDA):

1. target: the whole target (every layer, as the colocated line's first rank keeps it to decode) and its outbox
   (q_hs + 1 feature batches), one pass over preflight's worst-case batch of --budget tokens (after a warm-up
   pass at that size: kernels compiled and autotuned). Its transient (the pass above the weights and the outbox)
   is measured apart.
2. colocated worst case (the line's, as preflight measures it and the model sizes it): the target resident, the
   hidden-state queue (q_hs batches) and the batch in hand; two passes of --rows block rows over the whole budget
   of context (preflight's worst case: the second pass holds the first's gradients), then AdamW's step; the
   target's measured transient added (its pass may coincide with the drafter's peak).
3. the line on real batches (--line-steps steps): batches of the reference length mix, the target's pass, the
   queue and the drafter's step in turn, as the training runs them (the worst case bounds it).
4. split drafter: the target's layers freed (its embedding and LM head kept), the drafter with its receive
   queue (3 batches) and the batch in hand, the same two passes and step.

Allocated: ``torch.cuda.max_memory_allocated`` over the scenario. Device: what lies outside the allocator at its
end (``cudaMemGetInfo``'s used less the allocator's reserved bytes) plus ``max_memory_reserved``: the device's
use at the peak as CUDA counts it, without a cap (NVML's figures printed beside). Each beside the model's
``allocated`` and ``device``, with the error; the components measured apart beside theirs (target weights, its
pass, the drafter's state). ``--json`` is written after each shape (a run cut short keeps what it measured).

The 27B-shaped hybrid target (Qwen3.5/3.6) needs flash-linear-attention on CUDA (``pip install
flash-linear-attention==0.6.0 fla-core==0.6.0``, as docs/benchmarks/2026-12-hybrid-27b.md ran it); its first pass
autotunes fla's kernels (tens of seconds, in the warm-up).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (  # noqa: E402
    HYBRID, SHAPES, environment, lognormal_lengths, make_worker, packed_batch, random_target, target_config,
)

from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.model.target import TargetFeatures, default_attention  # noqa: E402
from draftline.objective.blocks import build_blocks  # noqa: E402
from draftline.pipeline.transport import RECEIVE_PREFETCH, Delivery  # noqa: E402
from draftline.sizing.memory_estimate import (  # noqa: E402
    MemoryEstimate, MemoryInputs, colocated_memory, drafter_memory, target_memory, target_pass_bytes,
)
from draftline.sizing.drafter_memory import MOMENT_BYTES, trained_params  # noqa: E402
from draftline.sizing.shapes import DrafterShape, TargetShape  # noqa: E402
from draftline.sizing.workload import worst_case_anchors, worst_case_batch  # noqa: E402

GIB = 2**30
NAN = float("nan")


# ------------------------------------------------------------------------------------------ measuring
class Meter:
    """Allocated and device peaks of one scenario on ``device`` (NaN on a CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> float:
        self.sync()
        return torch.cuda.memory_allocated(self.device) / GIB if self.cuda else NAN

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> dict:
        if not self.cuda:
            return {"allocated_gib": NAN, "reserved_gib": NAN, "device_gib": NAN, "outside_gib": NAN}
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside = (total - free - torch.cuda.memory_reserved(self.device)) / GIB
        reserved = torch.cuda.max_memory_reserved(self.device) / GIB
        return {"allocated_gib": torch.cuda.max_memory_allocated(self.device) / GIB, "reserved_gib": reserved,
                "device_gib": outside + reserved, "outside_gib": outside, "nvml": nvml_used(self.device)}


def nvml_used(device) -> dict | None:
    """NVML's used memory now: its first call (the driver's reserve counted) and its second (left out)."""
    try:
        import pynvml

        from draftline.monitor.gpu import nvml_handle, nvml_module

        nvml = nvml_module()
        handle = nvml_handle(nvml, device.index or 0)
        first = nvml.nvmlDeviceGetMemoryInfo(handle)
        out = {"v1_used_gib": first.used / GIB, "v1_total_gib": first.total / GIB}
        try:
            second = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            out.update(v2_used_gib=second.used / GIB, v2_reserved_gib=second.reserved / GIB)
        except Exception:  # noqa: BLE001 - an older driver or binding
            pass
        return out
    except Exception:  # noqa: BLE001 - no nvidia-ml-py: the CUDA figures stand alone
        return None


# ------------------------------------------------------------------------------------------ the scenarios
def worst_case_step(worker, tokens: int, rows: int, device, dtype, passes: int = 2) -> None:
    """Preflight's worst case: ``passes`` passes of ``rows`` block rows over ``tokens`` tokens of context (a later
    pass holds the earlier ones' gradients), then the optimizer's step; weights change, which memory does not mind."""
    objective = worker.objective
    block = objective.block_size
    anchors = max(1, min(rows // block, tokens - block - 1))
    batch = worst_case_batch(tokens, objective.embed_weight.shape[0])
    blocks = build_blocks(batch, worst_case_anchors(tokens, anchors, block), block_size=block,
                          mask_token_id=objective.mask_token_id, gamma=objective.gamma).to(device)
    features = torch.randn(tokens, objective.feature_width, device=device, dtype=dtype)
    for _ in range(passes):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = objective(features, blocks)
        loss.backward()
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)


def feature_batches(count: int, tokens: int, width: int, device, dtype) -> list[torch.Tensor]:
    return [torch.empty(tokens, width, device=device, dtype=dtype) for _ in range(count)]


def row(rows: list, shape: str, scenario: str, measured: dict, predicted: MemoryEstimate | None, *,
        predicted_gib: float | None = None, note: str = "") -> None:
    allocated = predicted.allocated if predicted is not None else predicted_gib
    device = predicted.device if predicted is not None else NAN
    entry = {"shape": shape, "scenario": scenario, **measured, "predicted_allocated_gib": allocated,
             "predicted_device_gib": device, "note": note,
             "error_allocated": (allocated - measured["allocated_gib"]) / measured["allocated_gib"],
             "error_device": (device - measured["device_gib"]) / measured["device_gib"]}
    if predicted is not None:
        entry["parts"] = {name: round(value, 3) for name, _, value in predicted.table()}
    rows.append(entry)
    print(f"{shape} | {scenario}: allocated {measured['allocated_gib']:.2f} GiB, the model {allocated:.2f} "
          f"({entry['error_allocated']:+.1%}); device {measured['device_gib']:.2f}, the model {device:.2f} "
          f"({entry['error_device']:+.1%}); outside the allocator {measured['outside_gib']:.2f}"
          + (f"; {note}" if note else ""), flush=True)


def component(rows: list, shape: str, name: str, measured: float, predicted: float) -> None:
    rows.append({"shape": shape, "scenario": f"component: {name}", "allocated_gib": measured,
                 "predicted_allocated_gib": predicted, "error_allocated": (predicted - measured) / measured})
    print(f"{shape} | component: {name}: measured {measured:.2f} GiB, the model {predicted:.2f} "
          f"({(predicted - measured) / measured:+.1%})", flush=True)


def run_shape(args, shape: str, budget: int, rows_per_pass: int, device, dtype, rows: list) -> None:
    meter = Meter(device)
    t0 = time.perf_counter()
    config = target_config(shape)
    drafter_cfg = build_drafter_config(config)
    layer_ids = list(drafter_cfg.dflash_config["target_layer_ids"])
    target_shape, drafter_shape = TargetShape.of(config), DrafterShape.of(drafter_cfg)
    layers_run = drafter_shape.target_layers_run
    width = len(layer_ids) * target_shape.hidden_size
    outbox = args.q_hs + 1  # one target: its outbox holds q_hs batches and the one being sent
    options = dict(recompute=args.recompute, moments=args.moments, head_chunk_rows=args.head_chunk_rows)
    print(f"\n== {shape}: --token-budget {budget:,}, --max-query-rows {rows_per_pass:,}, q_hs {args.q_hs}, "
          f"{args.recompute} recompute, {args.moments} moments, head chunks of {args.head_chunk_rows:,} rows", flush=True)

    if args.split_only:
        split_drafter(args, shape, budget, rows_per_pass, device, dtype, rows, meter, t0)
        return

    # ---- 1. the target
    meter.start()
    hybrid = shape in HYBRID
    model = random_target(shape, device, dtype, default_attention(device, hybrid))
    target = TargetFeatures.from_model(model, layer_ids, keep_all_layers=True)
    del model
    if device.type == "cuda" and not args.no_compile_target:
        from draftline.model.fused import compile_target

        compile_target(target)
    weights = meter.allocated()
    kept = target_memory(target_shape, layers_run, budget, len(layer_ids), outbox, layers_kept=target_shape.num_layers)
    component(rows, shape, f"target weights ({target_shape.num_layers} layers, embedding, head)", weights, kept.weights)
    worst = worst_case_batch(budget, target_shape.vocab_size)
    with torch.no_grad():
        target(worst)  # warm-up: compiled and autotuned at this size
    print(f"{shape}: target built and warmed up ({time.perf_counter() - t0:.0f} s)", flush=True)
    meter.start()
    box = feature_batches(outbox, budget, width, device, dtype)
    resident = meter.allocated()
    with torch.no_grad():
        features = target(worst)
    del features
    measured = meter.stop()
    transient = measured["allocated_gib"] - resident if device.type == "cuda" else NAN
    activations, built = target_pass_bytes(target_shape, layers_run, budget, len(layer_ids))
    component(rows, shape, "target pass above its weights and outbox (activations, the features it builds)",
              transient, (activations + built) / GIB)
    row(rows, shape, f"target (every layer, outbox of {outbox})", measured, kept)
    del box

    # ---- 2. the colocated worst case
    meter.start()
    before = meter.allocated()
    worker = make_worker(drafter_cfg, device, dtype, rows_per_pass, target.embed_weight(), target.head_weight(),
                         head_chunk_rows=args.head_chunk_rows, recompute=args.recompute, moments=args.moments)
    worst_case_step(worker, min(budget, args.warmup_tokens), min(rows_per_pass, args.warmup_rows), device, dtype)
    state = meter.allocated() - before
    params = trained_params(drafter_shape)
    component(rows, shape, f"drafter state (fp32 weights, {args.moments} moments)", state,
              (4 + MOMENT_BYTES[args.moments]) * params / GIB)
    print(f"{shape}: drafter built and warmed up ({time.perf_counter() - t0:.0f} s)", flush=True)
    meter.start()
    queue = feature_batches(args.q_hs, budget, width, device, dtype)
    worst_case_step(worker, budget, rows_per_pass, device, dtype)
    measured = meter.stop()
    del queue
    if device.type == "cuda":
        measured = {**measured, "allocated_gib": measured["allocated_gib"] + transient,
                    "device_gib": measured["device_gib"] + transient, "drafter_alone_gib": measured["allocated_gib"]}
    inputs = MemoryInputs(target_shape, drafter_shape, layers_run, len(layer_ids), args.q_hs, **options)
    row(rows, shape, "colocated worst case (the line's, as preflight measures it)", measured,
        colocated_memory(inputs, 1, budget, rows_per_pass), note="the target's pass added as measured in 1")
    print(f"{shape}: {time.perf_counter() - t0:.0f} s", flush=True)

    # ---- 3. the line on real batches
    if args.line_steps > 0:
        rng = np.random.default_rng(0)
        batches = [packed_batch(lognormal_lengths(rng, budget), target_shape.vocab_size, i, i)
                   for i in range(args.line_steps + args.q_hs)]
        meter.start()
        with torch.no_grad():
            waiting = collections.deque(Delivery(b.index, target(b), b) for b in batches[: args.q_hs])
        for b in batches[args.q_hs:]:
            delivery = waiting.popleft()
            worker.accumulate([delivery])
            worker.read_record()
            worker.queue_update()
            del delivery
            with torch.no_grad():
                waiting.append(Delivery(b.index, target(b), b))
        worker.read_record()
        measured = meter.stop()
        del waiting
        row(rows, shape, f"the line on real batches ({args.line_steps} steps, target and drafter in turn)", measured,
            colocated_memory(inputs, 1, budget, rows_per_pass),
            note="the worst case is its bound: real passes hold less context, the target's pass comes between steps")

    # ---- 4. the split drafter
    del target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"{shape}: the target's layers freed: {meter.allocated():.2f} GiB allocated (the drafter's state, the "
              f"embedding and head: {(12 * params + 4 * drafter_shape.vocab_size * drafter_shape.hidden_size) / GIB:.2f} "
              "expected with fp32 moments)", flush=True)
    split_step(args, shape, budget, rows_per_pass, device, dtype, rows, meter, worker, t0)


def split_drafter(args, shape: str, budget: int, rows_per_pass: int, device, dtype, rows: list, meter, t0) -> None:
    """Scenario 4 alone (``--split-only``): the drafter with the target's embedding and head only, as a split
    drafter rank holds them (random, at the target's shape), warmed up, then its worst case."""
    config = target_config(shape)
    vocab, hidden = config.vocab_size, config.hidden_size
    embed = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    head = embed if getattr(config, "tie_word_embeddings", False) else torch.randn(vocab, hidden, device=device,
                                                                                 dtype=dtype) * 0.02
    worker = make_worker(build_drafter_config(config), device, dtype, rows_per_pass, embed, head,
                         head_chunk_rows=args.head_chunk_rows, recompute=args.recompute, moments=args.moments)
    del embed, head  # the worker holds them
    worst_case_step(worker, min(budget, args.warmup_tokens), min(rows_per_pass, args.warmup_rows), device, dtype)
    print(f"{shape}: drafter built and warmed up ({time.perf_counter() - t0:.0f} s): {meter.allocated():.2f} GiB "
          "allocated", flush=True)
    split_step(args, shape, budget, rows_per_pass, device, dtype, rows, meter, worker, t0)


def split_step(args, shape: str, budget: int, rows_per_pass: int, device, dtype, rows: list, meter, worker,
               t0: float) -> None:
    """The split drafter's worst case: its receive queue and the batch in hand, the same two passes and step."""
    config = target_config(shape)
    drafter_cfg = build_drafter_config(config)
    width = len(drafter_cfg.dflash_config["target_layer_ids"]) * config.hidden_size
    meter.start()
    queue = feature_batches(RECEIVE_PREFETCH + 1, budget, width, device, dtype)
    worst_case_step(worker, budget, rows_per_pass, device, dtype)
    measured = meter.stop()
    del queue
    row(rows, shape, f"split drafter worst case (receive queue of {RECEIVE_PREFETCH + 1})", measured,
        drafter_memory(DrafterShape.of(drafter_cfg), budget, rows_per_pass, RECEIVE_PREFETCH + 1, num_gpus=1,
                       recompute=args.recompute, moments=args.moments, head_chunk_rows=args.head_chunk_rows),
        note="the target's embedding and head resident")
    print(f"{shape}: done in {time.perf_counter() - t0:.0f} s", flush=True)


def release(device) -> None:
    """A shape's compiled code and cached blocks given back (its worker gone with ``run_shape``), so that the next
    shape starts clean."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(rows: list) -> None:
    print("\n| shape | scenario | allocated GiB | model | error | device GiB | model | error | outside |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r.get(k, NAN):.2f}" for k in ("allocated_gib", "predicted_allocated_gib")]
        cells.append(f"{r.get('error_allocated', NAN):+.1%}")
        cells += [f"{r.get(k, NAN):.2f}" for k in ("device_gib", "predicted_device_gib")]
        cells += [f"{r.get('error_device', NAN):+.1%}", f"{r.get('outside_gib', NAN):.2f}"]
        print(f"| {r['shape']} | {r['scenario']} | " + " | ".join(cells) + " |")


def parse_sizes(text: str) -> list[tuple[str, int, int]]:
    """"8b=32768x32768,27b-hybrid=16384x8192" -> [(shape, token budget, query rows), ...]."""
    out = []
    for item in text.split(","):
        try:
            shape, sizes = item.split("=")
            budget, rows = (int(v) for v in sizes.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--sizes: {item!r} is not SHAPE=BUDGETxROWS (e.g. 8b=32768x32768)") from None
        if shape not in SHAPES and shape not in HYBRID:
            raise SystemExit(f"--sizes: unknown shape {shape!r}; one of {', '.join(sorted(SHAPES) + sorted(HYBRID))}")
        out.append((shape, budget, rows))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8b=32768x32768,27b-hybrid=16384x8192",
                        help="the shapes and their sizes, SHAPE=TOKEN_BUDGETxMAX_QUERY_ROWS comma-separated: the 8B line "
                             "of docs/benchmarks/2026-12-line-one-gpu.md and the 27B line on the seeds' card "
                             "(default: %(default)s)")
    parser.add_argument("--q-hs", type=int, default=2, help="the hidden-state queue, train's --q-hs (default: %(default)s)")
    parser.add_argument("--recompute", default="cheap", choices=["none", "cheap", "mlp"],
                        help="train's --recompute (default: %(default)s)")
    parser.add_argument("--moments", default="fp32", choices=["fp32", "bf16"], help="train's --moments (default: %(default)s)")
    parser.add_argument("--head-chunk-rows", type=int, default=4096,
                        help="train's --head-chunk-rows (default: %(default)s, train's)")
    parser.add_argument("--line-steps", type=int, default=2,
                        help="steps of the line on real batches; 0 skips it (default: %(default)s)")
    parser.add_argument("--warmup-tokens", type=int, default=8192,
                        help="tokens of the drafter's warm-up step (compilation, AdamW's state) (default: %(default)s)")
    parser.add_argument("--warmup-rows", type=int, default=4096,
                        help="query rows of the drafter's warm-up step (default: %(default)s)")
    parser.add_argument("--split-only", action="store_true",
                        help="measure only the split drafter (scenario 4): no target but its embedding and head, so "
                             "that the 27B shape's drafter fits an 80 GB card")
    parser.add_argument("--no-compile-target", action="store_true",
                        help="run the target eager (train compiles it on CUDA; this saves its compile time)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, or cpu to check that the script runs (no memory figures) (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the rows (and the environment) here, after each shape")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list = []
    for shape, budget, rows_per_pass in parse_sizes(args.sizes):
        run_shape(args, shape, budget, rows_per_pass, device, dtype, rows)
        release(device)
        if args.json:
            args.json.write_text(json.dumps({"environment": environment("flash-linear-attention", "fla-core", "nvidia-ml-py"), "args": vars(args) | {"json": str(args.json)},
                                             "rows": rows}, indent=1, default=lambda v: None if v != v else str(v)))
    print_table(rows)
    worst = max((abs(r["error_allocated"]) for r in rows if not math.isnan(r.get("error_allocated", NAN))
                 and "real batches" not in r["scenario"]), default=NAN)
    print(f"\nlargest error of the worst cases and components (allocated): {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
