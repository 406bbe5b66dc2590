"""Where the drafter step's memory goes: the accounting (any machine) and the measurement (CUDA), beside
SpecForge's own step on the same sample.

    python bench/drafter_memory.py --predict                        # the arithmetic, by component (no GPU)
    python bench/drafter_memory.py --predict --trace                # + what the compiled halves keep (CPU trace)
    python bench/drafter_memory.py --variants none+headcopy,cheap,mlp,peer,peer+liger --json mem.json   # GPU
    python bench/drafter_memory.py --device cpu --shape tiny --layers 2 --tokens 200 --anchors 8 --iters 1 \
        --warmup 1 --head-chunk-rows 64 --variants cheap,none+headcopy,cheap+bf16moments   # the variants run (CPU)

The accounting is the product's (``draftline.sizing.drafter_memory``, checked against the partitioner by
tests/sizing/test_drafter_memory.py); this script prints it by component and measures it.

The workload is bench_line's ``drafter-3072`` row: one 3,072-token sample, 512 anchors, block 16, the drafter
of the ``--shape`` target (5 layers), random bf16 embedding and LM head, one batch's features at a time, steps
back to back as the drafter role runs them (CUDA events; the median of ``--iters`` steps). Each variant builds
its drafter worker with the product's builder (``workloads.make_worker``), with the same seeds and batches, so
their losses can be compared step by step.

Variants ('+'-joined options):
  none / cheap / mlp   the compiled halves' recompute mode (``draftline.model.recompute``; ``cheap`` is the default)
  eager                no compilation
  ckpt                 whole decoder layers recomputed (``--activation-checkpointing``)
  headcopy             the LM head's gradient in a buffer of its own (the code before the in-place gradient)
  bf16moments          AdamW's moments in bf16, rounded stochastically (``optim.AdamWBf16Moments``: not exact)
  dspark               a DSpark drafter (``--method dspark``: the default heads, Markov rank 256, and its loss;
                       the features carry the target's final hidden state) instead of DFlash's
  chunkN               N rows of logits per head chunk (default ``--head-chunk-rows``)
  lossN                with ``dspark``: N rows per chunk of DSpark's loss (``DSparkLoss.chunk_rows``)
  stages               with ``dspark``: the loss chunk in three compiled stages, not the row kernel
                       (``DSparkLoss.row_kernel``)
  peer                 SpecForge 0.2.0's DFlash step: its draft model, training wrapper, chunked loss and
                       BF16Optimizer, on the same sample and features (needs ``specforge``, installed --no-deps)
  liger                with ``peer``: its Liger kernels (fused RMSNorm and SwiGLU; needs ``liger-kernel``)
  bf16adamw            with ``peer``: torch's fused AdamW on its bf16 weights (bf16 moments, no fp32 masters)
                       instead of its BF16Optimizer (fp32 masters and moments)
``none+headcopy`` is the code before the memory cuts; ``cheap`` the code after them; ``cheap,cheap+dspark`` the
two methods' steps side by side (docs/benchmarks/2026-12-dspark-step.md).

``--paired`` times the variants' steps in turn instead, one step of each a round after every variant's warm-up, so
that the clock (which the power cap moves) moves under each alike: each variant's median, its FLOPs and MFU, and the
median and range of every round's ratio to the first variant. Every variant is then resident at once: no memory
figures.

Measured per variant: step time, the FLOPs the product counts a step and the MFU they give (against the GPU's spec
peak, and against 788 TFLOP/s, the dense bf16 matmul rate measured on an H200), ``max_memory_allocated`` over the timed steps, reserved, the device's memory
in use (NVML, else ``cudaMemGetInfo``), memory after building and once the optimizer state exists, and in one
instrumented step: the memory each decoder layer keeps through the forward, the head loss's transient, and the
peaks of the forward, the backward and the optimizer step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import SHAPES, environment, make_worker, packed_batch, spec_peak, target_config  # noqa: E402

from draftline.methods import get_method  # noqa: E402
from draftline.model.config import build_drafter_config  # noqa: E402
from draftline.sizing.drafter_memory import (  # noqa: E402
    TRACE_SIZES, DrafterStepMemory, PassSize, compiled_part, drafter_step, layer_saved, traced_bytes, trained_params,
)
from draftline.sizing.peak import known_peak, mfu  # noqa: E402
from draftline.sizing.shapes import DrafterShape  # noqa: E402
from draftline.pipeline.transport import Delivery  # noqa: E402

GIB = 2**30
MIB = 2**20


# ------------------------------------------------------------------------------------------ the accounting
# The product's model (draftline.sizing.drafter_memory), printed by component.
def predict(shape: DrafterShape, size: PassSize, mode: str, chunk_rows: int, head_copy: bool,
            moments: str = "fp32") -> DrafterStepMemory:
    return drafter_step(shape, size, recompute=mode, head_chunk_rows=chunk_rows, moments=moments, head_copy=head_copy)


def print_prediction(shape: DrafterShape, size: PassSize, p: DrafterStepMemory, title: str) -> None:
    print(f"\n{title}: {trained_params(shape) / 1e9:.3f} B trained parameters, {size.query_rows:,} query rows, "
          f"{size.context_rows:,} context rows, {size.label_rows:,} labelled rows")
    rows = [(k, v) for k, (_, v) in p.fixed.items()]
    rows += [(f"per layer: {k}", v) for k, v in p.per_layer[0].items()]
    rows += [(f"all {len(p.per_layer)} layers", p.layers_kept)]
    rows += list(p.context.items()) + [(f"head: {k}", v) for k, v in p.head.items() if v]
    for name, value in rows:
        print(f"  {value / GIB:7.3f} GiB  {name}")
    print(f"  {p.forward_end / GIB:7.2f} GiB  at the end of the forward (in the head loss)")
    print(f"  {p.backward / GIB:7.2f} GiB  in the backward (largest, layer by layer)")
    print(f"  {p.backward_end / GIB:7.2f} GiB  at the end of the backward / optimizer step "
          f"(+ {p.gradients / GIB:.2f} GiB of fp32 gradients)")
    print(f"  {p.peak / GIB:7.2f} GiB  predicted peak")


def print_peer_floor(shape: DrafterShape, size: PassSize) -> None:
    """SpecForge's BF16Optimizer layout, by arithmetic: what its step holds whatever its activations."""
    P = trained_params(shape)
    fixed = 2 * 2 * shape.vocab_size * shape.hidden_size + 2 * size.context_rows * len(shape.target_layer_ids) * shape.hidden_size
    held = 2 * P + 4 * P + 8 * P + fixed
    print(f"\nSpecForge 0.2.0's step (its BF16Optimizer), whatever its activations: bf16 weights {2 * P / GIB:.2f} + "
          f"fp32 masters {4 * P / GIB:.2f} + fp32 moments {8 * P / GIB:.2f} + embedding, head and features "
          f"{fixed / GIB:.2f} = {held / GIB:.2f} GiB held; its optimizer step adds the bf16 gradients and their fp32 "
          f"copies ({6 * P / GIB:.2f} GiB) before AdamW runs: at least {(held + 6 * P) / GIB:.2f} GiB at that moment")
    plain = 2 * P + 4 * P + fixed
    print(f"The same model with torch's AdamW on its bf16 weights (bf16 moments, no fp32 masters): {plain / GIB:.2f} "
          f"GiB held, + {2 * P / GIB:.2f} GiB of bf16 gradients at the end of the backward")


def print_trace(mode: str, shape: DrafterShape, size: PassSize) -> None:
    """What the compiled halves keep, traced on a tiny layer (``drafter_memory.traced_bytes``), sized here."""
    print(f"\ncompiled halves, recompute={mode!r}: kept for backward, traced on a tiny layer ({TRACE_SIZES['Q']} query "
          f"rows, {TRACE_SIZES['T']} context rows), sized at the {shape.hidden_size}-wide shape")
    total, entries = traced_bytes(mode, shape, size)
    for half, dims, size_bytes, is_input in entries:
        print(f"  {half:26s} {size_bytes / MIB:8.1f} MiB  {dims}" + ("  (an input of the half)" if is_input else ""))
    formula = compiled_part(layer_saved(shape, shape.layers[0], size, mode))
    print(f"  {'':26s} {total / MIB:8.1f} MiB  in all, inputs left out (the formula's compiled part: {formula / MIB:.1f})")


# ------------------------------------------------------------------------------------------ the measurement
OVERHEAD = ("Command Buffer Full",)
"""CUPTI's records of a launch that waited for room in the command buffer: not a kernel (the CPU was ahead of the GPU),
but the profiler lists them as device time and adds them to the operator that launched."""

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _kernels(event) -> list:
    """The kernels an operator launched (its children's included), CUPTI's overhead left out."""
    return ([k for k in event.kernels if k.name not in OVERHEAD]
            + [k for child in event.cpu_children for k in _kernels(child)])


def _inside_matmul(event) -> bool:
    """Whether a matmul call runs inside another one (its kernels are that one's already)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in MATMULS:
            return True
        parent = parent.cpu_parent
    return False


def _matmul_flop(name: str, shapes) -> float:
    """2 M N K of a matmul call from its inputs' shapes (``addmm``'s first input is the one added)."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _annotation(name: str) -> bool:
    """A range the profiler shows on the GPU's timeline for a span of host code (a compiled graph's call, the optimizer's
    step), not a kernel: its time is its kernels' again."""
    return name.startswith("## ") or "#" in name


def _matmul_calls(prof, steps: int, listed: dict) -> dict:
    """Each matmul call of a profile by its name and inputs' shapes: its kernels' device time a step, their rate and
    names; and the check of those kernels against their totals in the kernels' list (``listed``, ms a step)."""
    from torch.autograd import DeviceType

    calls: dict = {}
    for event in prof.events():
        if event.name in MATMULS and event.device_type == DeviceType.CPU and not _inside_matmul(event):
            call = calls.setdefault((event.name, str(event.input_shapes)), {"us": 0.0, "n": 0, "flop": 0.0, "by": {}})
            call["n"] += 1
            call["flop"] += _matmul_flop(event.name, event.input_shapes)
            for kernel in _kernels(event):
                call["us"] += kernel.duration
                call["by"][kernel.name] = call["by"].get(kernel.name, 0.0) + kernel.duration
    lines, attributed = [], {}
    for (name, shapes), c in sorted(calls.items(), key=lambda item: -item[1]["us"]):
        if c["us"] <= 0:
            continue
        by = sorted(c["by"].items(), key=lambda kv: -kv[1])
        for kernel, us in by:
            attributed[kernel] = attributed.get(kernel, 0.0) + us / 1e3 / steps
        lines.append(f"{c['us'] / 1e3 / steps:8.2f} ms  x{c['n'] // steps:<4d} {c['flop'] / c['us'] / 1e6:5.0f} TFLOP/s  "
                     f"{name} {shapes}  <- " + "; ".join(f"{k[:48]} {us / 1e3 / steps:.2f}" for k, us in by))
    check = [f"{kernel[:60]}: {ms:.2f} ms in the calls, {listed.get(kernel, 0.0):.2f} in the kernels' list"
             for kernel, ms in attributed.items() if abs(ms - listed.get(kernel, 0.0)) > 0.05]
    return {"matmuls": lines, "matmul_ms_per_step": sum(attributed.values()), "matmul_check": check}


def kernel_profile(step, steps: int = 3, top: int = 30, matmuls: bool = False) -> dict:
    """``steps`` steps under torch's profiler: each kernel's device time a step (ms), the ``top`` largest first, and
    the steps' whole device time (kernels only; CUPTI's "Command Buffer Full" records apart). Kernel names of
    compiled code name the operations they fuse. ``matmuls``: also each matmul call (``aten::mm``, ``addmm``,
    ``bmm``, ``baddbmm``) by its inputs' shapes, with its kernels' device time a step and their rate, so that
    matmuls whose kernels share a name are told apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if matmuls else [])
    with profile(activities=activities, record_shapes=matmuls) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    device = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
              and not _annotation(e.key)]
    kernels = [(e.key, e.self_device_time_total / 1e3 / steps, e.count // steps) for e in device
               if e.key not in OVERHEAD]
    kernels.sort(key=lambda k: -k[1])
    result = {"device_ms_per_step": sum(k[1] for k in kernels),
              # whatever device type the profiler gives these records (a GPU run listed them as not CUDA's)
              "overhead_ms_per_step": sum(e.self_device_time_total for e in prof.key_averages()
                                          if e.key in OVERHEAD) / 1e3 / steps,
              "kernels": [f"{ms:8.2f} ms  x{n:<4d} {name[:110]}" for name, ms, n in kernels[:top]]}
    if matmuls:
        result.update(_matmul_calls(prof, steps, {name: ms for name, ms, _ in kernels}))
    return result


def _allocated() -> float:
    return torch.cuda.memory_allocated() / GIB


def _peak(reset: bool = True) -> float:
    value = torch.cuda.max_memory_allocated() / GIB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return value


def peak_owners(step, top: int = 16) -> dict:
    """Run ``step`` under CUDA's allocation history and sum what is live at its peak by the innermost frame in
    draftline's or bench's code that allocated it (inductor's generated code is named by its caller)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        events = [e for trace in torch.cuda.memory._snapshot()["device_traces"] for e in trace]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def replay(until: int):
        live, now, best, at = {}, base, base, -1
        for i, e in enumerate(events[:until]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                now += e["size"]
            elif e["action"] == "free_requested":
                live.pop(e["addr"], None)
                now -= e["size"]
            if now > best:
                best, at = now, i
        return live, best, at

    _, best, at = replay(len(events))
    live, _, _ = replay(at + 1)

    def owner(e) -> str:
        for f in e.get("frames") or []:
            name = f.get("filename", "")
            if "draftline" in name or "/bench/" in name:
                return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
        return "(no draftline frame)"

    sums: dict[str, list] = {}
    for e in live.values():
        entry = sums.setdefault(owner(e), [0, 0])
        entry[0] += e["size"]
        entry[1] += 1
    rows = sorted(sums.items(), key=lambda kv: -kv[1][0])
    return {"peak_gib": best / GIB, "held_before_step_gib": base / GIB,
            "owners": [f"{size / GIB:.3f} GiB in {count}: {where}" for where, (size, count) in rows[:top]]}


class Probe:
    """Memory at each decoder layer's forward and around the head loss during one instrumented step."""

    def __init__(self, layers):
        self.layer_kept: list[float] = []
        self.head: dict = {}
        self.forward_peak = float("nan")
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._before))
            self._handles.append(layer.register_forward_hook(self._after))
        self._at = 0.0

    def _before(self, _module, _args):
        self._at = _allocated()

    def _after(self, _module, _args, _out):
        self.layer_kept.append(_allocated() - self._at)

    def head_call(self, fn):
        def measured(*args, **kwargs):
            before = _allocated()
            self.head["before_gib"] = before
            self.forward_peak = _peak()  # the forward up to the head
            out = fn(*args, **kwargs)
            self.head["peak_gib"] = _peak()
            self.head["transient_gib"] = self.head["peak_gib"] - before
            return out

        return measured

    def close(self):
        for handle in self._handles:
            handle.remove()


def saved_by_layer(layers, forward) -> dict:
    """Bytes autograd saves during ``forward()`` (one forward, no backward), by where they were saved: before the
    layers, in layer i, after them (final norm, head). Each storage counted once, where it was first saved. Inside a
    compiled region it sees what the compiled function saves; inside an eager selective-recompute region, nothing
    (that region's own hooks take over)."""
    where, seen, found = ["before the layers"], set(), {}

    def pack(t):
        ptr = (t.device, t.untyped_storage().data_ptr())
        if ptr not in seen:
            seen.add(ptr)
            entry = found.setdefault(where[0], {"mib": 0.0, "tensors": 0, "largest": []})
            entry["mib"] += t.untyped_storage().nbytes() / MIB
            entry["tensors"] += 1
            entry["largest"].append((t.untyped_storage().nbytes() / MIB, f"{list(t.shape)} {str(t.dtype)[6:]}"))
        return t

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_a, _i=i: where.__setitem__(0, f"layer {_i}")))
        handles.append(layer.register_forward_hook(lambda *_a: where.__setitem__(0, "after the layers")))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for handle in handles:
            handle.remove()
    for entry in found.values():
        entry["mib"] = round(entry["mib"], 1)
        entry["largest"] = [f"{mib:.0f} MiB {what}" for mib, what in sorted(entry["largest"], reverse=True)[:6]]
    return found


def _features(b, width, device, dtype):
    g = torch.Generator(device=device).manual_seed(1000 + b.index)
    return torch.randn(b.num_tokens, width, generator=g, device=device, dtype=dtype)


def _frozen(cfg, device, dtype):
    g = torch.Generator(device=device).manual_seed(7)
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    return embed, head


def _device_used(device) -> float:
    from draftline.monitor.gpu import device_stats

    used = device_stats(device).mem_used_gib
    return float("nan") if used is None else used


class Ours:
    """draftline's drafter worker for one variant."""

    def __init__(self, opts, cfg, args, device, dtype):
        from draftline.model.drafter import checkpoint_layers
        from draftline.model.fused import compile_drafter

        if "dspark" in opts:
            cfg = get_method("dspark").build_config(cfg)
        embed, head = _frozen(cfg, device, dtype)
        chunk = next((int(o[5:]) for o in opts if o.startswith("chunk")), args.head_chunk_rows)
        self.worker = make_worker(cfg, device, dtype, args.max_query_rows, embed, head, chunk, compile_layers=False,
                                  attention=args.attention)
        self.worker.objective.settings.max_anchors = args.anchors
        loss_rows = next((int(o[4:]) for o in opts if o.startswith("loss")), None)
        if loss_rows is not None:
            self.worker.objective.loss.chunk_rows = loss_rows
        if "stages" in opts:
            self.worker.objective.loss.row_kernel = False
        if "ckpt" in opts:
            checkpoint_layers(self.worker.drafter)
        mode = next((m for m in ("none", "cheap", "mlp") if m in opts), "cheap")
        if "eager" not in opts and device.type == "cuda":
            compile_drafter(self.worker.drafter, recompute=mode)
        moments = "bf16" if "bf16moments" in opts else "fp32"
        if moments != "fp32":
            from draftline.config import OptimConfig
            from draftline.pipeline.optim import build_optimizer, build_scheduler

            self.worker.optimizer = build_optimizer(self.worker.drafter, OptimConfig(), moments=moments)
            self.worker.scheduler = build_scheduler(self.worker.optimizer, OptimConfig(), 1000)
        self.headcopy = "headcopy" in opts
        self.layers = self.worker.drafter.layers
        self.width = self.worker.objective.feature_width
        # The accounting is DFlash's (the memory model adds a method's term apart: sizing.memory_estimate).
        self.predicted = None if opts & {"eager", "ckpt", "dspark"} else (mode, chunk, self.headcopy, moments)

    def patch(self):
        """Swap in the head-loss body of the code before the in-place gradient (a second [R, V] buffer)."""
        import draftline.objective.head_loss as hl

        if not self.headcopy:
            return lambda: None
        original = hl._fused_loss_and_grad
        compiled = torch.compile(hl.loss_and_grad_of_logits, dynamic=True)

        def separate(raw, labels, row_weights, multiplier, softcap, teacher_raw, distill, need_grad):
            loss, correct, grad, ce = compiled(raw, labels, row_weights, multiplier, softcap, teacher_raw, distill,
                                               need_grad)
            if need_grad:
                raw.copy_(grad)
            return loss, correct, ce

        hl._fused_loss_and_grad = lambda: separate
        return lambda: setattr(hl, "_fused_loss_and_grad", original)

    def step(self, delivery):
        """One step as the drafter role runs it; the record of the step before (None for the first)."""
        self.worker.accumulate([delivery])
        record = self.worker.read_record()
        self.worker.queue_update()
        return record

    def last(self):
        return self.worker.read_record()

    def forward_only(self, delivery):
        objective = self.worker.objective
        blocks = objective.blocks(delivery.batch).pin_memory().to(delivery.features.device)
        with self.worker._autocast():
            return objective(delivery.features, blocks)[0]

    def instrumented(self, delivery, probe: Probe) -> dict:
        import draftline.objective.loss as objective_loss

        original = objective_loss.chunked_head_loss
        marks = {}

        def head(*args, **kwargs):
            loss_sum, correct = probe.head_call(original)(*args, **kwargs)

            def backward_starts(grad):
                marks["forward_rest_peak"] = _peak()
                return grad

            loss_sum.register_hook(backward_starts)
            return loss_sum, correct

        objective_loss.chunked_head_loss = head
        try:
            self.worker.accumulate([delivery])
        finally:
            objective_loss.chunked_head_loss = original
        torch.cuda.synchronize()
        marks["after_backward_gib"] = _allocated()
        marks["backward_peak_gib"] = _peak()
        self.worker.read_record()
        self.worker.queue_update()
        self.worker.read_record()
        torch.cuda.synchronize()
        marks["optimizer_peak_gib"] = _peak()
        return marks


class _ClippedAdamW:
    """torch's fused AdamW over a bf16 model's own weights (so bf16 moments and no fp32 master copy), the gradients
    clipped to ``max_grad_norm`` first: the peer's model with the plainest optimizer, for comparison."""

    def __init__(self, model, lr: float, max_grad_norm: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, fused=True)
        self.max_grad_norm = max_grad_norm

    def step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


class Peer:
    """SpecForge 0.2.0's own DFlash step: its draft model (with its Liger kernels if asked), training wrapper
    (anchors, flex mask, chunked checkpointed loss) and BF16Optimizer, built by its own functions."""

    def __init__(self, opts, cfg, args, device, dtype):
        import copy
        import types

        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.algorithms.dflash.providers import build_draft
        from specforge.optimizer import BF16Optimizer

        run = types.SimpleNamespace(
            model=types.SimpleNamespace(torch_dtype="bfloat16", use_liger_kernel="liger" in opts,
                                        draft_checkpoint_path=None),
            training=types.SimpleNamespace(strategy="dflash",
                                           attention_backend="flex_attention" if device.type == "cuda" else "sdpa"))
        torch.manual_seed(0)
        self.draft = build_draft(run, copy.deepcopy(cfg))  # z-lab config, as a checkpoint's config.json carries it
        embed, head = _frozen(cfg, device, torch.bfloat16)  # the peer runs in bf16 throughout
        lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
        lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
        embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        embed_tokens.weight = torch.nn.Parameter(embed, requires_grad=False)
        self.model = OnlineDFlashModel(self.draft, lm_head, embed_tokens, int(cfg.dflash_config["mask_token_id"]),
                                       block_size=int(cfg.block_size), attention_backend=run.training.attention_backend,
                                       num_anchors=args.anchors, loss_decay_gamma=7.0, objective_chunk_blocks=128)
        self.model.to(device=device)
        self.model.train()
        if "bf16adamw" in opts:  # torch's fused AdamW on the bf16 weights: bf16 moments, no fp32 masters
            self.optimizer = _ClippedAdamW(self.draft, lr=6e-4, max_grad_norm=1.0)
        else:
            self.optimizer = BF16Optimizer(self.draft, lr=6e-4, max_grad_norm=1.0, total_steps=1000,
                                           warmup_ratio=0.04)
        self.layers = self.draft.layers
        self.width = len(cfg.dflash_config["target_layer_ids"]) * cfg.hidden_size
        self.predicted = None
        self._record = None

    def patch(self):
        return lambda: None

    def _forward(self, delivery):
        b = delivery.batch
        return self.model(input_ids=b.input_ids[None].to(delivery.features.device),
                          hidden_states=delivery.features[None].to(torch.bfloat16),
                          loss_mask=b.loss_mask.long()[None].to(delivery.features.device))

    def forward_only(self, delivery):
        return self._forward(delivery)[0]

    def step(self, delivery):
        loss, _accuracy, _ = self._forward(delivery)
        loss.backward()
        norm = self.optimizer.step()
        previous, self._record = self._record, (loss.detach(), norm)
        return previous

    def last(self):
        return self._record

    def instrumented(self, delivery, probe: Probe) -> dict:
        import specforge.algorithms.common.dflash_family_model as peer_model

        original = peer_model.checkpointed_chunk_reduce
        peer_model.checkpointed_chunk_reduce = probe.head_call(original)
        try:
            loss, _, _ = self._forward(delivery)
        finally:
            peer_model.checkpointed_chunk_reduce = original
        torch.cuda.synchronize()
        marks = {"forward_rest_peak": _peak()}
        loss.backward()
        torch.cuda.synchronize()
        marks["after_backward_gib"] = _allocated()
        marks["backward_peak_gib"] = _peak()
        self.optimizer.step()
        torch.cuda.synchronize()
        marks["optimizer_peak_gib"] = _peak()
        return marks


def _loss_of(record):
    if record is None:
        return None
    if isinstance(record, tuple):  # the peer's (loss, grad norm) on the device
        return {"loss": float(record[0]), "grad_norm": float(record[1])}
    return {"loss": record.loss, "grad_norm": record.grad_norm}


def measures_memory(device: torch.device) -> bool:
    """Whether the memory figures (torch.cuda's allocator statistics) exist for ``device``."""
    return device.type == "cuda"


def _mark(cuda: bool):
    """A point in time: a CUDA event recorded on the stream, else the host's clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _spans_ms(ends: list, cuda: bool) -> list[float]:
    """The milliseconds between consecutive marks (after the stream has reached the last)."""
    if cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(ends, ends[1:])]
    return [1e3 * (b - a) for a, b in zip(ends, ends[1:])]


CEILING_FLOPS = known_peak("NVIDIA H200").ceiling  # the H200's measured bf16 matmul rate: the second MFU's base


def _mfus(tflop_per_step: float, step_ms: float, device) -> dict:
    """{"mfu_spec": ``sizing.peak.mfu`` of a step's counted FLOPs against the GPU's spec peak, "mfu_ceiling": the same
    against 788 TFLOP/s}; NaN off CUDA (a CPU's rate is no base for MFU: sizing.peak.PeakFlops.for_mfu)."""
    if device.type != "cuda":
        return {"mfu_spec": float("nan"), "mfu_ceiling": float("nan")}
    flops, seconds = tflop_per_step * 1e12, step_ms / 1e3
    return {"mfu_spec": mfu(flops, seconds, spec_peak(device)), "mfu_ceiling": mfu(flops, seconds, CEILING_FLOPS)}


def _arm_flops(arm) -> float | None:
    """The FLOPs the arm's drafter worker has counted so far (None for an arm without the product's counter)."""
    counters = getattr(getattr(arm, "worker", None), "counters", None)
    return None if counters is None else counters.flops


def run_variant(name: str, args, cfg, device, dtype, shape: DrafterShape, size: PassSize) -> dict:
    cuda = measures_memory(device)
    torch._dynamo.reset()  # each variant compiles afresh: none inherits another's graphs or uses up its cache
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result: dict = {"variant": name, "start_gib": _allocated() if cuda else float("nan")}
    arm = _arm(name, args, cfg, device, dtype)
    unpatch = arm.patch()
    try:
        if cuda:
            torch.cuda.synchronize()
            result["after_build_gib"] = _allocated()
        batches = [packed_batch([args.tokens], cfg.vocab_size, i, i) for i in range(args.warmup + args.iters + 1)]

        def delivery(b):
            return Delivery(b.index, _features(b, arm.width, device, dtype), b)

        records = []
        t0 = time.perf_counter()
        for b in batches[: args.warmup]:
            records.append(arm.step(delivery(b)))
        if cuda:
            torch.cuda.synchronize()
            result["after_optimizer_state_gib"] = _allocated()  # weights, moments, no gradients, one batch's features
        result["warmup_s"] = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ends = [_mark(cuda)]
        flops0 = _arm_flops(arm)
        for b in batches[args.warmup: args.warmup + args.iters]:
            records.append(arm.step(delivery(b)))
            ends.append(_mark(cuda))
        records.append(arm.last())
        times = _spans_ms(ends, cuda)
        if cuda:
            result.update(peak_gib=_peak(reset=False), reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                          device_used_gib=_device_used(device))
        result["step_ms"] = [round(t, 2) for t in times]
        result["step_ms_median"] = statistics.median(times)
        result["step_ms_mean"] = statistics.fmean(times)
        if flops0 is not None:
            result["tflop_per_step"] = (_arm_flops(arm) - flops0) / args.iters / 1e12
            result.update(_mfus(result["tflop_per_step"], result["step_ms_median"], device))
        result["losses"] = [_loss_of(r) for r in records if r is not None]
        if cuda:
            probe = Probe(arm.layers)
            try:
                torch.cuda.synchronize()
                _peak()
                start = _allocated()
                marks = arm.instrumented(delivery(batches[-1]), probe)
            finally:
                probe.close()
            result["step_start_gib"] = start
            result["layer_kept_mib"] = [round(g * GIB / MIB, 1) for g in probe.layer_kept]
            result["forward_peak_gib"] = max(probe.forward_peak, probe.head.get("peak_gib", float("nan")),
                                             marks.pop("forward_rest_peak", float("nan")))
            result["head"] = probe.head
            result.update(marks)
        if args.peak_owners and cuda:
            result["peak_owners"] = peak_owners(lambda: arm.step(delivery(batches[-1])))
        if args.profile and cuda:
            result["profile"] = kernel_profile(lambda: arm.step(delivery(batches[-1])), top=args.profile_kernels,
                                               matmuls=args.profile_matmuls)
        if args.saved_tensors:
            try:
                result["saved_tensors"] = saved_by_layer(arm.layers, lambda: arm.forward_only(delivery(batches[-1])))
            except Exception as exc:  # noqa: BLE001 - a report beside the measurement, not the measurement
                result["saved_tensors"] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        unpatch()
    if arm.predicted is not None:
        result["predicted_peak_gib"] = predict(shape, size, *arm.predicted).peak / GIB
    del arm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _arm(name: str, args, cfg, device, dtype):
    opts = set(name.split("+"))
    return (Peer if "peer" in opts else Ours)(opts, cfg, args, device, dtype)


def run_paired(names: list[str], args, cfg, device, dtype) -> dict:
    """The variants' steps in turn, one step of each a round (``--iters`` rounds) after each one's warm-up, on the same
    batches: {variant: step times}, each variant's median and the median of every round's ratio to the first's."""
    if any("headcopy" in name.split("+") for name in names):
        raise SystemExit("--paired: 'headcopy' swaps a function for every variant at once; time it without --paired")
    cuda = device.type == "cuda"
    batches = [packed_batch([args.tokens], cfg.vocab_size, i, i) for i in range(args.warmup + args.iters + 1)]
    arms = {}
    for name in names:
        arm = arms[name] = _arm(name, args, cfg, device, dtype)
        for b in batches[: args.warmup]:
            arm.step(Delivery(b.index, _features(b, arm.width, device, dtype), b))

    flops0 = {name: _arm_flops(arm) for name, arm in arms.items()}
    order, ends = [], [_mark(cuda)]
    for b in batches[args.warmup: args.warmup + args.iters]:
        for name, arm in arms.items():
            delivery = Delivery(b.index, _features(b, arm.width, device, dtype), b)
            arm.step(delivery)
            order.append(name)
            ends.append(_mark(cuda))
    for arm in arms.values():
        arm.last()
    spans = _spans_ms(ends, cuda)
    times = {name: [t for n, t in zip(order, spans) if n == name] for name in names}
    first = times[names[0]]
    ratios = {n: [t / f for t, f in zip(ts, first)] for n, ts in times.items()}
    result = {"paired": True, "rounds": args.iters, "step_ms": {n: [round(t, 2) for t in ts] for n, ts in times.items()},
              "step_ms_median": {n: statistics.median(ts) for n, ts in times.items()},
              "ratio_to_first_median": {n: statistics.median(r) for n, r in ratios.items()},
              "ratio_to_first_range": {n: (min(r), max(r)) for n, r in ratios.items()}, "tflop_per_step": {},
              "mfu_spec": {}, "mfu_ceiling": {}}
    for name, arm in arms.items():
        if flops0[name] is not None:
            tflop = result["tflop_per_step"][name] = (_arm_flops(arm) - flops0[name]) / args.iters / 1e12
            for key, value in _mfus(tflop, result["step_ms_median"][name], device).items():
                result[key][name] = value
    print(f"\n{'variant (paired)':24s} {'ms med':>8s} {'ms mean':>8s} {'TFLOP':>6s} {'MFU spec':>8s} {'MFU 788':>8s} "
          f"{'/ first: median of rounds (range)':>34s}")
    nan = float("nan")
    for name, ts in times.items():
        low, high = result["ratio_to_first_range"][name]
        print(f"{name:24s} {statistics.median(ts):8.1f} {statistics.fmean(ts):8.1f} "
              f"{result['tflop_per_step'].get(name, nan):6.2f} {100 * result['mfu_spec'].get(name, nan):7.1f}% "
              f"{100 * result['mfu_ceiling'].get(name, nan):7.1f}% "
              f"{result['ratio_to_first_median'][name]:19.3f} ({low:.3f}-{high:.3f})")
    return result


def print_table(results: list[dict]) -> None:
    cols = [("step_ms_median", "ms med", "8.1f"), ("step_ms_mean", "ms mean", "8.1f"), ("tflop_per_step", "TFLOP", "6.1f"),
            ("mfu_spec", "MFU sp", "6.3f"), ("mfu_ceiling", "MFU788", "6.3f"), ("peak_gib", "peak", "7.2f"),
            ("predicted_peak_gib", "pred", "6.2f"), ("reserved_gib", "resv", "6.2f"), ("device_used_gib", "device", "7.2f"),
            ("after_build_gib", "built", "6.2f"), ("after_optimizer_state_gib", "+optim", "6.2f"),
            ("forward_peak_gib", "fwd pk", "6.2f"), ("backward_peak_gib", "bwd pk", "6.2f"),
            ("optimizer_peak_gib", "opt pk", "6.2f")]
    print("\n" + f"{'variant':24s} " + " ".join(f"{label:>{len(format(0.0, fmt))}s}" for _, label, fmt in cols)
          + "  layer kept MiB | head transient GiB | first losses")
    for r in results:
        if "failed" in r:
            print(f"{r['variant']:24s} failed: {r['failed'].strip().splitlines()[-1][:150]}")
            continue
        cells = " ".join(format(r.get(key, float("nan")), fmt) for key, _, fmt in cols)
        layers = r.get("layer_kept_mib") or []
        losses = ", ".join(f"{x['loss']:.4f}" for x in r.get("losses", [])[:4] if x and x.get("loss") is not None)
        print(f"{r['variant']:24s} {cells}  {'/'.join(f'{x:.0f}' for x in layers)} | "
              f"{r.get('head', {}).get('transient_gib', float('nan')):.2f} | {losses}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="the target shape the drafter is built for")
    parser.add_argument("--layers", type=int, default=5, help="drafter layers")
    parser.add_argument("--tokens", type=int, default=3072, help="tokens of the one sample per step")
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sample (the blocks of a pass)")
    parser.add_argument("--head-chunk-rows", type=int, default=2048,
                        help="rows of logits per LM-head chunk (bench_line's default, under which 23.4 GiB was measured)")
    parser.add_argument("--max-query-rows", type=int, default=32768, help="block rows per pass (one pass here)")
    parser.add_argument("--attention", default="auto", choices=["auto", "flex", "flash", "dense"],
                        help="the drafter's attention ('auto': FlashAttention-4 if installed and it passes its check)")
    parser.add_argument("--variants", default="none+headcopy,cheap",
                        help="comma-separated variants, each a '+'-joined set of options (see above)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per variant (rounds with --paired)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu runs the steps (a check that the variants run; no memory figures)")
    parser.add_argument("--predict", action="store_true", help="print the accounting and exit")
    parser.add_argument("--trace", action="store_true",
                        help="with --predict: what the compiled halves keep, traced on this machine (CPU is enough)")
    parser.add_argument("--saved-tensors", action="store_true",
                        help="also list what autograd saves in one more forward, by layer (saved-tensor hooks)")
    parser.add_argument("--peak-owners", action="store_true",
                        help="also run one step under CUDA's allocation history and print what is live at its peak, "
                             "by the code that allocated it")
    parser.add_argument("--profile", action="store_true",
                        help="also run three steps under torch's profiler and print each kernel's device time a step")
    parser.add_argument("--profile-kernels", type=int, default=30,
                        help="with --profile: how many kernels to print, the largest first (default: %(default)s)")
    parser.add_argument("--profile-matmuls", action="store_true",
                        help="with --profile: also print every matmul call by its inputs' shapes, with its kernels' "
                             "device time a step and their rate")
    parser.add_argument("--paired", action="store_true",
                        help="time the variants' steps in turn, one of each a round (no memory figures)")
    parser.add_argument("--json", type=Path, help="write the results (and the environment) here")
    args = parser.parse_args()
    cfg = build_drafter_config(target_config(args.shape), num_hidden_layers=args.layers, block_size=16)
    anchors = min(args.anchors, args.tokens - 1)
    shape, size = DrafterShape.of(cfg), PassSize.of(anchors, 16, args.tokens)
    if args.predict:
        for mode, headcopy, moments in (("none", True, "fp32"), ("cheap", False, "fp32"), ("mlp", False, "fp32"),
                                        ("cheap", False, "bf16")):
            print_prediction(shape, size, predict(shape, size, mode, args.head_chunk_rows, headcopy, moments),
                             f"recompute={mode!r}, head chunk {args.head_chunk_rows} rows"
                             + (", its gradient in its own buffer" if headcopy else ", gradient in place")
                             + f", {moments} AdamW moments")
        print_peer_floor(shape, size)
        if args.trace:
            for mode in ("none", "cheap", "mlp"):
                print_trace(mode, shape, size)
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.paired:
        paired = run_paired(args.variants.split(","), args, cfg, device, dtype)
        if args.json:
            args.json.write_text(json.dumps({"environment": environment("specforge", "liger-kernel", "flash-attn-4"),
                                             "args": vars(args) | {"json": str(args.json)}, "results": paired},
                                            indent=1, default=str))
        return 0
    results = []
    for name in args.variants.split(","):
        try:
            results.append(run_variant(name, args, cfg, device, dtype, shape, size))
        except Exception:  # noqa: BLE001 - one failing variant must not hide the others
            results.append({"variant": name, "failed": traceback.format_exc()[-3000:]})
            print(results[-1]["failed"], flush=True)
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("step_ms", "losses")}), flush=True)
        if args.json:  # after every variant: a call cut short by its time limit keeps what it measured
            args.json.write_text(json.dumps({"environment": environment("specforge", "liger-kernel", "flash-attn-4"), "args": vars(args) | {"json": str(args.json)},
                                             "results": results}, indent=1, default=str))
    print_table(results)
    for r in results:
        owners = r.get("peak_owners")
        if owners:
            print(f"  {r['variant']}: live at the step's peak, {owners['peak_gib']:.2f} GiB "
                  f"({owners['held_before_step_gib']:.2f} held before the step):")
            for line in owners["owners"]:
                print(f"    {line}")
        prof = r.get("profile")
        if prof:
            print(f"  {r['variant']}: kernels, {prof['device_ms_per_step']:.1f} ms of device time a step "
                  f"(and {prof['overhead_ms_per_step']:.1f} ms of CUPTI's 'Command Buffer Full', left out):")
            for line in prof["kernels"]:
                print(f"    {line}")
            if prof.get("matmuls"):
                print(f"  {r['variant']}: matmuls by their inputs' shapes, {prof['matmul_ms_per_step']:.1f} ms a step:")
                for line in prof["matmuls"]:
                    print(f"    {line}")
                for line in prof["matmul_check"]:
                    print(f"    a kernel whose sum over the calls is not its own total: {line}")
        for where, entry in (r.get("saved_tensors") or {}).items():
            print(f"  {r['variant']}: saved {where}: " + (entry if isinstance(entry, str) else
                  f"{entry['mib']:.0f} MiB in {entry['tensors']} storages; largest {'; '.join(entry['largest'])}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
