"""Each target family through the real loading path: Qwen3, Llama, Qwen3-MoE, Qwen3.5 hybrid, Qwen3.5-MoE.

Features of a batch of documents equal each document run alone through the Hugging Face model; the
packed hybrid path (Gated DeltaNet given document boundaries) equals the padded one; a
vision-language checkpoint loads as its text model only.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftline.data.batch import PackedBatch
from draftline.errors import DraftlineError
from draftline.model import linear_attention
from draftline.model.linear_attention import Kernels
from draftline.model.target import TargetFeatures, load_embedding_and_head
from helpers import make_qwen3_5_target

# With flash-linear-attention installed, transformers runs Gated DeltaNet layers with its GPU-only kernels
# even on CPU; TargetFeatures refuses that with a clear error, so the CPU checks of hybrid targets need it absent.
no_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                            reason="flash-linear-attention installed: hybrid targets run on GPU only")
FAMILIES = ["qwen3_target", "llama_target", "qwen3_moe_target",
            pytest.param("qwen3_5_target", marks=no_fla), pytest.param("qwen3_5_moe_target", marks=no_fla)]


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [(torch.randint(0, 300, (n,), generator=g).tolist(), [True] * n) for n in lengths]
    return docs, PackedBatch.from_documents(docs)


def _hf_layer_outputs(target_dir, docs, layer_ids):
    """What HF itself gives per document: hidden_states[l + 1] is the output of layer l."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids, _ in docs:
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            rows.append(torch.cat([hidden[i + 1][0] for i in layer_ids], dim=-1))
    return torch.cat(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_features_equal_each_document_alone(family, request):
    target_dir = request.getfixturevalue(family)
    docs, batch = _batch([37, 5, 61, 20])
    features = TargetFeatures(target_dir, [0, 2], dtype=torch.float32)
    assert features.layers_run == 3 and len(features.decoder.layers) == 3  # deeper layers are not loaded
    torch.testing.assert_close(features(batch), _hf_layer_outputs(target_dir, docs, [0, 2]), rtol=1e-4, atol=1e-4)


def _reference_kernels() -> Kernels:
    """transformers' own pure-torch Gated DeltaNet functions, run one document at a time (CPU stand-in for fla)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    def per_document(fn, num_sequences):
        def run(*args):
            *args, cu_seqlens = args
            bounds = cu_seqlens.tolist()
            pieces = [fn(*[t[:, a:b] for t in args[:num_sequences]], *args[num_sequences:])
                      for a, b in zip(bounds[:-1], bounds[1:])]
            return torch.cat(pieces, dim=1)

        return run

    def conv(x, weight, bias, activation):
        return hf.causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)

    def delta_rule(q, k, v, g, beta):
        repeat = v.shape[2] // q.shape[2]  # each key head serves `repeat` consecutive value heads
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        out, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        return out

    return Kernels(per_document(conv, 1), per_document(delta_rule, 5))


@no_fla
@pytest.mark.parametrize("family", ["qwen3_5_target", "qwen3_5_moe_target"])
def test_packed_hybrid_path_equals_padded(family, request, monkeypatch):
    """The packed path's wiring (boundaries to every Gated DeltaNet layer, document mask to the full-attention
    layers, one row) on CPU, with transformers' torch kernels per document standing in for fla's."""
    target_dir = request.getfixturevalue(family)
    monkeypatch.setattr(linear_attention, "fla_kernels", _reference_kernels)
    docs, batch = _batch([29, 3, 70, 16], seed=1)
    padded = TargetFeatures(target_dir, [1, 4], dtype=torch.float32)
    packed = TargetFeatures(target_dir, [1, 4], dtype=torch.float32, packed=True)
    assert packed.hybrid and packed.packed and not padded.packed
    torch.testing.assert_close(packed(batch), padded(batch), rtol=1e-4, atol=1e-4)

    # Without boundaries the conv's taps or the recurrent state would run from one document into the next: the test
    # tells either of them apart, each alone.
    for kernel in ("conv", "delta_rule"):
        leaky = TargetFeatures(target_dir, [1, 4], dtype=torch.float32, packed=True)
        monkeypatch.setattr(linear_attention, "fla_kernels", lambda kernel=kernel: _leaky(_reference_kernels(), kernel))
        assert not torch.allclose(leaky(batch), padded(batch), rtol=1e-3, atol=1e-3), kernel


@no_fla
def test_compiled_hybrid_stages_give_the_same_features_with_one_graph_each(qwen3_5_target, monkeypatch):
    """compile_target compiles a packed Gated DeltaNet layer's two stages around fla's kernels (graph capture only on
    CPU: aot_eager): the features stay those of the eager pass, and each stage is one graph for every layer and every
    batch (the layers' modules are inputs, not constants it specialises on)."""
    import torch._dynamo

    from draftline.model.fused import compile_target

    monkeypatch.setattr(linear_attention, "fla_kernels", _reference_kernels)
    eager = TargetFeatures(qwen3_5_target, [1, 4], dtype=torch.float32, packed=True)
    compiled = TargetFeatures(qwen3_5_target, [1, 4], dtype=torch.float32, packed=True)
    graphs: dict[str, int] = {}

    def counting(fn):
        def backend(gm, _inputs):
            graphs[fn.__name__] = graphs.get(fn.__name__, 0) + 1
            return gm.forward

        return backend

    original = torch.compile
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: original(
        fn, dynamic=dynamic, backend=counting(fn) if fn in (linear_attention.project_inputs,
                                                            linear_attention.gated_output) else "aot_eager"))
    compile_target(compiled)
    monkeypatch.setattr(torch, "compile", original)
    linear_layers = sum(hasattr(layer, "linear_attn") for layer in compiled.decoder.layers)
    assert linear_layers >= 2
    for lengths in ([29, 3, 70, 16], [12, 40], [70, 9, 3]):
        _, batch = _batch(lengths, seed=len(lengths))
        torch.testing.assert_close(compiled(batch), eager(batch), rtol=1e-5, atol=1e-5)
    assert graphs == {"project_inputs": 1, "gated_output": 1}


def _leaky(kernels: Kernels, kernel: str) -> Kernels:
    """``kernels`` with ``kernel`` ("conv" or "delta_rule") told that the whole row is one document."""

    def whole_row(fn):
        return lambda *args: fn(*args[:-1], torch.tensor([0, args[0].shape[1]]))

    return dataclasses.replace(kernels, **{kernel: whole_row(getattr(kernels, kernel))})


@no_fla
def test_hybrid_without_fla_names_the_install_command(qwen3_5_target, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def refuse_fla(name, *args, **kwargs):
        if name == "fla" or name.startswith("fla."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse_fla)
    features = TargetFeatures(qwen3_5_target, [1], dtype=torch.float32, packed=True)
    with pytest.raises(DraftlineError, match=r"draftline\[hybrid\]"):
        features(_batch([8, 9])[1])


@no_fla
def test_vision_language_checkpoint_loads_its_text_model_only(qwen3_5_vl_target, tmp_path):
    """Features equal those of the text-only model with the same weights; no vision or MTP tensor is held."""
    from safetensors.torch import load_file

    features = TargetFeatures(qwen3_5_vl_target, [1, 4], dtype=torch.float32)
    names = list(features.model.state_dict())
    assert names and not any("visual" in n or n.startswith("mtp") for n in names)

    # The same weights saved as a text-only model.
    saved = load_file(qwen3_5_vl_target / "model.safetensors")
    text_dir = make_qwen3_5_target(tmp_path / "text", seed=1)
    model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    state = {n: saved[n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n]
             for n in model.state_dict()}
    model.load_state_dict(state)
    model.save_pretrained(text_dir)
    docs, batch = _batch([33, 12])
    torch.testing.assert_close(features(batch), TargetFeatures(text_dir, [1, 4], dtype=torch.float32)(batch))

    embed, head = load_embedding_and_head(qwen3_5_vl_target)
    torch.testing.assert_close(embed, saved["model.language_model.embed_tokens.weight"])
    torch.testing.assert_close(head, saved["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_training_steps_and_eval_through_the_cli(family, request, tmp_path):
    """`draftline train` (two steps) and `draftline eval` (speculative decoding with the drafter) per family:
    both steps train on a finite loss, and decoding is lossless: the target's own greedy continuation."""
    import json
    import math

    from draftline.cli import main
    from line_helpers import base_args, step_losses, write_dataset

    target_dir = request.getfixturevalue(family)
    data = write_dataset(tmp_path / "data", num_docs=12, max_len=60)
    run_dir = tmp_path / "run"
    args = base_args(target_dir, data, run_dir, max_steps=2, target_layer_ids="1,3", trace=True)
    assert main(["train", *args]) == 0
    losses = step_losses(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["status"] == "finished" and (run_dir / "final" / "config.json").is_file()
    assert losses.keys() == {1, 2} and all(math.isfinite(v) and v > 0 for v in losses.values()), losses
    last_train = [r for r in records if r["kind"] == "train"][-1]
    assert last_train["skipped_steps"] == 0 and math.isfinite(last_train["grad_norm"]) and last_train["grad_norm"] > 0

    prompt = [5, 6, 7, 8, 9]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": prompt}) + "\n")
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(target_dir), "--drafter", str(run_dir / "final"), "--prompts", str(prompts),
                 "--max-new-tokens", "10", "--stop-token-ids", "none", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    entry = result["per_prompt"][0]
    assert entry["output_ids"] == prompt + _greedy(target_dir, prompt, 10)
    lengths = entry["acceptance_lengths"]  # the first new token comes from the prefill, the rest from blocks
    assert sum(lengths) == 9 and all(1 <= n <= 4 for n in lengths)
    assert result["tau"] == pytest.approx(9 / len(lengths))


def _greedy(target_dir, prompt: list[int], num_tokens: int) -> list[int]:
    """The target alone, greedy, the whole sequence each time (no cache): the reference decoding must match."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["qwen3_target", "llama_target", "qwen3_moe_target"])
def test_packed_row_equals_padded_rows(family, request):
    """The packed path (one row, per-document mask: a dense one on CPU) equals one padded row per document."""
    target_dir = request.getfixturevalue(family)
    docs, batch = _batch([29, 3, 70, 16], seed=2)
    packed = TargetFeatures(target_dir, [1, 3], dtype=torch.float32, packed=True)
    padded = TargetFeatures(target_dir, [1, 3], dtype=torch.float32)
    torch.testing.assert_close(packed(batch), padded(batch), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_target_gives_the_same_features(family, request):
    """compile_target (graph capture only on CPU: aot_eager) changes no feature, and packed batches of
    new lengths reuse the compiled layers (dynamic shapes: no compilation per batch)."""
    import torch._dynamo

    from draftline.model.fused import compile_target

    target_dir = request.getfixturevalue(family)
    eager = TargetFeatures(target_dir, [0, 2], dtype=torch.float32)
    compiled = TargetFeatures(target_dir, [0, 2], dtype=torch.float32)
    original = torch.compile
    torch._dynamo.reset()
    try:
        torch.compile = lambda fn, dynamic=None, options=None: original(fn, dynamic=dynamic, backend="aot_eager")
        compile_target(compiled)
    finally:
        torch.compile = original
    torch._dynamo.utils.counters.clear()
    for lengths in ([37, 5, 61, 20], [12, 40], [70, 9, 3]):
        _, batch = _batch(lengths, seed=len(lengths))
        torch.testing.assert_close(compiled(batch), eager(batch), rtol=1e-5, atol=1e-5)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] > 0  # the compiled functions ran in the feature pass
    ok_after_first = frames["ok"]
    _, batch = _batch([25, 33, 8, 14, 2], seed=9)
    compiled(batch)
    assert torch._dynamo.utils.counters["frames"]["ok"] == ok_after_first  # a fifth shape: nothing recompiled
