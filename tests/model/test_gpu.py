"""The GPU paths against the CPU references (skipped without CUDA).

The hybrid checks cost little on a fresh machine: one small model shape, one packed batch (so flex
compiles once per dtype), and every fla kernel given one fixed launch config instead of Triton
autotuning each of its configs on first use (fla's documented ``FLA_CACHE_MODE=default`` with
``FLA_CONFIG_DIR``; the configs are each kernel's own, so only speed depends on the choice).

    pytest -rA -m gpu tests/model/test_gpu.py -k hybrid    # -rA: each test's norm-relative differences
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

import pytest
import torch

from draftline.data.batch import PackedBatch
from draftline.model import linear_attention
from draftline.model.attention import DenseAttention, FlexAttention
from draftline.model.target import TargetFeatures
from helpers import layout_for

pytestmark = pytest.mark.gpu


def test_flex_drafter_attention_equals_dense_on_cuda():
    torch.manual_seed(0)
    lengths = [900, 77, 1500]
    anchors = [list(range(1, 890, 13)), list(range(0, 70, 9)), list(range(5, 1490, 11))]
    layout = layout_for(lengths, anchors, 16).to("cuda")
    q = torch.randn(1, 8, layout.num_queries, 64, device="cuda")
    k = torch.randn(1, 2, layout.num_context + layout.num_queries, 64, device="cuda")
    v = torch.randn_like(k)
    types = ["full_attention", "sliding_attention"]
    flex, dense = FlexAttention(layout, types, 256, 0.125), DenseAttention(layout, types, 256, 0.125)
    for layer in range(2):
        torch.testing.assert_close(flex(q, k, v, layer), dense(q, k, v, layer), rtol=2e-3, atol=2e-3)


def _attention_and_grads(attend, inputs, layer, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    out = attend(*leaves, layer)
    out.float().square().sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_drafter_attention_matches_dense_as_closely_as_flex(head_dim):
    """FlashAttention-4's kernels (flex's FLASH backend) in bf16: output and gradients within 2x the
    error of flex's Triton kernels in bf16, both against dense attention in fp32; the probe passes."""
    from draftline.model.attention import flash_unavailable, probe_flash

    reason = flash_unavailable(torch.device("cuda"), head_dim)
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    layout = layout_for([900, 77, 1500], [list(range(1, 890, 13)), list(range(0, 70, 9)), list(range(5, 1490, 11))],
                        16).to("cuda")
    keys = layout.num_context + layout.num_queries
    inputs = [torch.randn(1, h, n, head_dim, device="cuda") for h, n in ((8, layout.num_queries), (2, keys), (2, keys))]
    types, scale = ["full_attention", "sliding_attention"], head_dim**-0.5
    flash = FlexAttention(layout, types, 256, scale, kernel="flash")
    flex = FlexAttention(layout, types, 256, scale)
    dense = DenseAttention(layout, types, 256, scale)
    for layer in range(2):
        ref = _attention_and_grads(dense, inputs, layer, torch.float32)
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), _attention_and_grads(flash, inputs, layer, torch.bfloat16),
                                 _attention_and_grads(flex, inputs, layer, torch.bfloat16), ref):
            err_flash, err_flex = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
            print(f"{types[layer]} {name}: flash {err_flash:.2e}, flex {err_flex:.2e}")
            assert err_flash <= 2 * err_flex + 1e-3, (types[layer], name, err_flash, err_flex)
    config = type("C", (), {"head_dim": head_dim, "num_attention_heads": 8, "num_key_value_heads": 2,
                            "layer_types": types, "sliding_window": 256})()
    assert probe_flash(torch.device("cuda"), config) is None


def test_flex_target_features_equal_per_document_sdpa(qwen3_target):
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 300, (n,), generator=g).tolist(), [True] * n) for n in (300, 7, 513, 129)]
    batch = PackedBatch.from_documents(docs)
    flex = TargetFeatures(qwen3_target, [1, 4], device="cuda", dtype=torch.float32)
    assert flex.attn == "flex_attention"
    sdpa = TargetFeatures(qwen3_target, [1, 4], device="cuda", dtype=torch.float32, attn_implementation="sdpa")
    out = flex(batch)
    start = 0
    for n in batch.doc_lengths.tolist():
        one = PackedBatch.from_documents([docs.pop(0)])
        torch.testing.assert_close(out[start : start + n], sdpa(one), rtol=1e-3, atol=1e-3)
        start += n


# ------------------------------------------------------------------------------------- hybrid targets
LENGTHS = [300, 7, 1000, 129, 2]  # shorter and longer than fla's 64-token chunks; one packed batch for all checks
LAYERS = [1, 3, 6]  # after Gated DeltaNet layers (1, 6) and after a full-attention layer (3)
FP32_TOL = 5e-3  # ||packed - alone|| / ||alone||, fp32 (fla's kernels use tf32 dots inside)
BF16_FACTOR = 2.0  # bf16: at most this many times the bf16 reference's own rounding error (see below)


def _lightest(configs):
    """The config least likely to exceed shared memory (stages x tile sizes smallest), then ~4 warps."""
    def size(config):
        tiles = [v for v in config.kwargs.values() if isinstance(v, int)]
        return (config.num_stages or 1) * math.prod(tiles), abs((config.num_warps or 4) - 4)

    return min(configs, key=size)


def _fla_autotuners(kind) -> list:
    """fla's kernels behind its config cache, found in the loaded fla modules (Heuristics -> Autotuner -> JIT)."""
    found = {}
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("fla.") and m is not None]:
        for value in list(vars(module).values()):
            try:
                for _ in range(3):
                    if isinstance(value, kind) and value.configs:
                        found[id(value)] = value
                        break
                    value = getattr(value, "fn", None)
            except Exception:  # noqa: BLE001 - an attribute that is not a kernel
                continue
    return list(found.values())


@pytest.fixture(scope="module")
def fla_one_config(tmp_path_factory):
    """Every kernel behind fla's config cache launches with one of its own configs (no autotuning).

    Documented by fla (ENVs.md): ``FLA_CACHE_MODE=default`` reads ``$FLA_CONFIG_DIR/<kernel>.json``'s
    ``default_config``. The mode is read when fla is imported; if fla was imported before this module
    ran, the module's setting is changed to the same value. Anything unexpected: fla autotunes as usual.
    """
    saved_env = {k: os.environ.get(k) for k in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    folder = tmp_path_factory.mktemp("fla_configs")
    cache = previous_mode = None
    try:
        if "fla" not in sys.modules:
            os.environ["FLA_CACHE_MODE"] = "default"
        import fla.modules.causal_conv1d  # noqa: F401 - what linear_attention.fla_kernels uses
        import fla.ops.gated_delta_rule  # noqa: F401

        cache = importlib.import_module("fla.ops.utils.cache")

        previous_mode = cache.FLA_CACHE_MODE
        cache.FLA_CACHE_MODE = cache.FlaCacheMode.DEFAULT
        written = 0
        for tuner in _fla_autotuners(cache.CachedAutotuner):
            c = _lightest(tuner.configs)
            entry = {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
                     "num_ctas": getattr(c, "num_ctas", 1), "maxnreg": getattr(c, "maxnreg", None)}
            (folder / f"{tuner.kernel_name}.json").write_text(json.dumps({"default_config": entry}))
            written += 1
        os.environ["FLA_CONFIG_DIR"] = str(folder)
        print(f"\nfla: one fixed launch config for {written} kernels ({folder})")
    except Exception as exc:  # noqa: BLE001 - a speed-up only: without it fla autotunes (minutes)
        print(f"\nfla: fixed launch configs not set ({type(exc).__name__}: {exc}); fla autotunes")
    yield
    if cache is not None and previous_mode is not None:
        cache.FLA_CACHE_MODE = previous_mode
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _gpu_hybrid_target(path, moe: bool):
    """A small hybrid target with head sizes like the real ones' kernels see (64-wide heads).

    Its weights are rounded to bf16 before saving, so the fp32 runs use exactly the bf16 runs'
    weights: their difference is the bf16 arithmetic's alone."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(0)
    sizes = dict(vocab_size=512, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=8192,
                 initializer_range=0.05, tie_word_embeddings=False)
    if moe:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**sizes, moe_intermediate_size=128, num_experts=4,
                                                           shared_expert_intermediate_size=128, num_experts_per_tok=2))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes, intermediate_size=512))
    model.to(torch.bfloat16).float().save_pretrained(path)
    return path


class _Runs:
    """Each (target, dtype, packed) loaded once; the packed batch and each document's own run computed once."""

    def __init__(self, folder):
        self.folder = folder
        g = torch.Generator().manual_seed(0)
        self.docs = [(torch.randint(0, 500, (n,), generator=g).tolist(), [True] * n) for n in LENGTHS]
        self.batch = PackedBatch.from_documents(self.docs)
        self._features, self._alone = {}, {}

    def features(self, moe: bool, dtype: torch.dtype, packed: bool) -> TargetFeatures:
        key = (moe, dtype, packed)
        if key not in self._features:
            path = self.folder / ("moe" if moe else "dense")
            if not path.is_dir():
                _gpu_hybrid_target(path, moe)
            self._features[key] = TargetFeatures(path, LAYERS, device="cuda", dtype=dtype,
                                                 attn_implementation=None if packed else "sdpa")
            assert self._features[key].packed == packed and self._features[key].hybrid
        return self._features[key]

    def alone(self, moe: bool, dtype: torch.dtype) -> list[torch.Tensor]:
        """transformers' own forward (SDPA, its fla calls without boundaries), one document at a time."""
        if (moe, dtype) not in self._alone:
            target = self.features(moe, dtype, packed=False)
            self._alone[moe, dtype] = [target(PackedBatch.from_documents([doc])).float() for doc in self.docs]
        return self._alone[moe, dtype]

    def packed(self, moe: bool, dtype: torch.dtype, kernels=None) -> list[torch.Tensor]:
        """The packed pass (fla given the boundaries, flex block mask), cut back into documents."""
        target = self.features(moe, dtype, packed=True)
        own = target._kernels
        target._kernels = kernels or own
        try:
            out = target(self.batch).float()
        finally:
            target._kernels = own
        return list(torch.split(out, LENGTHS))


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, fla_one_config):
    pytest.importorskip("fla")
    return _Runs(tmp_path_factory.mktemp("hybrid"))


def _relative(rows: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    """[documents, feature layers]: ||rows - ref|| / ||ref|| of each document's rows at each layer."""
    hidden = refs[0].shape[1] // len(LAYERS)
    return torch.tensor([[float((a[:, k * hidden:(k + 1) * hidden] - b[:, k * hidden:(k + 1) * hidden]).norm()
                                / b[:, k * hidden:(k + 1) * hidden].norm()) for k in range(len(LAYERS))]
                         for a, b in zip(rows, refs)])


def _table(name: str, values: torch.Tensor) -> str:
    lines = [f"{name}: ||diff|| / ||ref|| per document (rows: lengths) and feature layer {LAYERS}"]
    lines += [f"  {n:>5} tokens: " + "  ".join(f"{v:.2e}" for v in row.tolist()) for n, row in zip(LENGTHS, values)]
    return "\n".join(lines)


def test_packed_hybrid_bf16_features_within_rounding_of_each_document_alone(hybrid_runs):
    """bf16, packed vs each document alone, measured against the bf16 arithmetic's own error: the
    difference of the packed pass from the bf16 reference is at most twice the reference's distance
    from fp32 with the same weights (two independent roundings of that size differ by ~1.4x it)."""
    packed = hybrid_runs.packed(False, torch.bfloat16)
    alone = hybrid_runs.alone(False, torch.bfloat16)
    rounding = _relative(alone, hybrid_runs.alone(False, torch.float32))
    diff = _relative(packed, alone)
    report = _table("bf16 packed vs bf16 alone", diff) + "\n" + _table("bf16 alone vs fp32 alone (rounding)", rounding)
    print("\n" + report)
    assert (diff <= BF16_FACTOR * rounding).all(), report


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_packed_hybrid_fp32_features_equal_each_document_alone(hybrid_runs, moe):
    diff = _relative(hybrid_runs.packed(moe, torch.float32), hybrid_runs.alone(moe, torch.float32))
    report = _table(f"fp32 packed vs fp32 alone ({'moe' if moe else 'dense'})", diff)
    print("\n" + report)
    assert (diff <= FP32_TOL).all(), report


def test_hybrid_state_crossing_documents_is_caught(hybrid_runs):
    """The same packed pass with the Gated DeltaNet state and conv running over the whole row (fla told
    one sequence): the bf16 check above fails, by far, on the documents that follow another."""
    from draftline.model import linear_attention

    real = hybrid_runs.features(False, torch.bfloat16, packed=True)._kernels or linear_attention.fla_kernels()

    def whole_row(fn):
        return lambda *args: fn(*args[:-1], torch.tensor([0, args[0].shape[1]], device=args[0].device))

    leaky = linear_attention.Kernels(whole_row(real.conv), whole_row(real.delta_rule))
    alone = hybrid_runs.alone(False, torch.bfloat16)
    rounding = _relative(alone, hybrid_runs.alone(False, torch.float32))
    diff = _relative(hybrid_runs.packed(False, torch.bfloat16, kernels=leaky), alone)
    report = _table("bf16 packed, state crossing documents, vs alone", diff)
    print("\n" + report)
    assert (diff[0] <= BF16_FACTOR * rounding[0]).all(), report  # nothing comes before the first document
    assert float((diff[1:] / rounding[1:]).max()) > 10 * BF16_FACTOR, report  # caught by a wide margin


def test_compiled_packed_hybrid_bf16_features_within_rounding_of_each_document_alone(hybrid_runs):
    """The packed pass as training runs it (``compile_target``: each Gated DeltaNet layer's stages around fla's kernels
    compiled, as are its norms and MLP and the full-attention layers), bf16, against each document alone: within the
    bound the eager packed pass is held to above."""
    from draftline.model.fused import compile_target

    hybrid_runs.features(False, torch.bfloat16, packed=True)  # saves the target
    compiled = compile_target(TargetFeatures(hybrid_runs.folder / "dense", LAYERS, device="cuda", dtype=torch.bfloat16))
    assert compiled.packed and compiled.linear_stages != linear_attention.Stages()
    rows = list(torch.split(compiled(hybrid_runs.batch).float(), LENGTHS))
    alone = hybrid_runs.alone(False, torch.bfloat16)
    rounding = _relative(alone, hybrid_runs.alone(False, torch.float32))
    diff = _relative(rows, alone)
    report = _table("bf16 packed, compiled, vs bf16 alone", diff)
    print("\n" + report)
    assert (diff <= BF16_FACTOR * rounding).all(), report
