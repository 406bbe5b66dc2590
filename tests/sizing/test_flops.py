"""FLOP counter: hand-computed tiny cases, the dense mask's pair count, the reference table, each layer kind."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from transformers import Qwen3Config

from draftline.model.attention import BlockLayout, dense_mask
from draftline.model.config import build_drafter_config
from draftline.sizing.flops import (
    FULL,
    SLIDING,
    DrafterShape,
    TargetShape,
    attention_flops,
    drafter_flops,
    drafter_flops_breakdown,
    gpu_spec,
    known_peak,
    linear_flops,
    measure_peak_flops,
    mfu,
    resolve_peak,
    target_flops,
)
from draftline.sizing.workload import reference_drafter_flops, reference_target_flops

TINY_TARGET = TargetShape.uniform(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                                  num_layers=3, vocab_size=10)
TINY_DRAFTER = DrafterShape.uniform(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                                    num_layers=2, vocab_size=10, target_layer_ids=(0, 1), block_size=4)


def test_linear_and_attention_rules():
    assert linear_flops(3, 5, 7) == 3 * 2 * 35
    assert linear_flops(3, 5, 7, backward=True) == 3 * 6 * 35
    assert linear_flops(3, 5, 7, backward=True, input_grad=False) == 3 * 4 * 35
    assert attention_flops(10, 2, 4) == 4 * 2 * 4 * 10
    assert attention_flops(10, 2, 4, backward=True) == 3 * 4 * 2 * 4 * 10


def test_target_tiny_by_hand():
    # Per layer and token: q 8x8, o 8x8, k 8x4, v 8x4, MLP 3x8x16 = 576 weights -> 2*576 FLOPs.
    linears = 2 * 576 * 5 * 2  # 5 tokens, 2 layers run
    # Causal pairs: a 3-token document has 1+2+3, a 2-token one 1+2; forward 4*heads*head_dim each.
    attention = 2 * 4 * 2 * 4 * (6 + 3)
    assert target_flops(TINY_TARGET, [3, 2], num_layers_run=2) == linears + attention
    # Packing is free: two documents cost less attention than one of the same total length.
    assert target_flops(TINY_TARGET, torch.tensor([3, 2]), 2) < target_flops(TINY_TARGET, [5], 2)


def test_target_rejects_more_layers_than_it_has():
    with pytest.raises(ValueError, match="num_layers_run"):
        target_flops(TINY_TARGET, [4], num_layers_run=4)


def test_drafter_tiny_by_hand():
    parts = drafter_flops_breakdown(TINY_DRAFTER, num_context_rows=6, anchor_positions=[1, 3], num_labelled_rows=5)
    assert parts["layers"] == 2 * 8 * 6 * 576  # 2 layers, 2 anchors x 4 rows, fwd+bwd with input grad
    assert parts["context_kv"] == 2 * 6 * 6 * (2 * 8 * 4)  # k, v over 6 context rows, input grad (C is trained)
    assert parts["fc"] == 6 * 4 * (2 * 8 * 8)  # K*H -> H, forward + weight gradient only
    # Visible keys per row = anchor position + block: 4 rows x (1 + 4) + 4 rows x (3 + 4) = 48.
    assert parts["attention"] == 2 * 3 * 4 * 2 * 4 * 48
    assert parts["lm_head"] == 5 * 4 * 8 * 10  # frozen head: forward + input gradient
    assert drafter_flops(TINY_DRAFTER, num_context_rows=6, anchor_positions=[1, 3], num_labelled_rows=5) == 73792


def test_drafter_rejects_labels_on_slot_zero():
    with pytest.raises(ValueError, match="slot 0"):
        drafter_flops(TINY_DRAFTER, num_context_rows=6, anchor_positions=[1, 3], num_labelled_rows=7)


@pytest.mark.parametrize("sliding, window", [(False, None), (True, None), (True, 3), (True, 6)])
def test_attention_pairs_match_the_dense_mask(sliding, window):
    # Two documents, anchors anywhere in them: the counter's pairs equal the mask's True entries.
    doc_lengths = torch.tensor([7, 5])
    context_doc = torch.repeat_interleave(torch.arange(2), doc_lengths)
    context_pos = torch.cat([torch.arange(7), torch.arange(5)])
    anchor_doc, anchor_pos = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 2, 6, 1, 4])
    layout = BlockLayout(context_doc, context_pos, anchor_doc, anchor_pos, block_size=4)
    base = DrafterShape.uniform(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                                num_layers=1, vocab_size=10, target_layer_ids=(0,), block_size=4)
    layer = dataclasses.replace(base.layers[0], kind=SLIDING if sliding else FULL, window=window)
    shape = dataclasses.replace(base, layers=(layer,))
    parts = drafter_flops_breakdown(shape, num_context_rows=12, anchor_positions=anchor_pos, num_labelled_rows=0)
    pairs = parts["attention"] / attention_flops(1, 2, 4, backward=True)
    assert pairs == int(dense_mask(layout, sliding=sliding, window=window).sum())


def _qwen3(hidden, layers, heads, intermediate):
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       head_dim=128, intermediate_size=intermediate, vocab_size=151936)


def _by_hand(hidden, heads, kv_heads, head_dim, intermediate, vocab, layers_run, feature_layers, *,
             length=2826, anchors=512, block=16, draft_layers=5):
    """docs/FLOPS.md's rules applied to the shapes, written out here (not through the counter):
    the target's forward over one ``length``-token document up to its deepest feature layer, and one
    drafter step on it with ``anchors`` anchors spread evenly (mean position (length-1)/2)."""
    attn_weights = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    layer_weights = attn_weights + 3 * hidden * intermediate  # + gate, up, down
    causal_pairs = length * (length + 1) / 2
    target = layers_run * (2 * layer_weights * length + 4 * heads * head_dim * causal_pairs)
    rows = anchors * block
    layers = draft_layers * 6 * layer_weights * rows  # forward 2 + backward 4 per weight and row
    context_kv = draft_layers * 6 * (hidden * kv_heads * head_dim * 2) * length
    fc = 4 * (feature_layers * hidden * hidden) * length  # forward + weight gradient only
    pairs = anchors * block * ((length - 1) / 2 + block)  # each slot: the context before its anchor, its block
    attention = draft_layers * 3 * 4 * heads * head_dim * pairs
    head = 4 * hidden * vocab * anchors * (block - 1)  # frozen head: forward + input gradient, labelled rows
    return target, layers + context_kv + fc + attention + head


@pytest.mark.parametrize(
    "target_config, layer_ids, by_hand, target_tflop, drafter_tflop, samples_s, ktok_s",
    [
        (_qwen3(4096, 36, 32, 12288), (1, 9, 17, 25, 33), _by_hand(4096, 32, 8, 128, 12288, 151936, 34, 5),
         39.3, 71.1, 7.1, 20.2),
        (_qwen3(5120, 64, 64, 25600), (1, 16, 31, 46, 61), _by_hand(5120, 64, 8, 128, 25600, 151936, 62, 5),
         179, 152, 2.4, 6.7),
    ],
    ids=["qwen3-8b", "qwen3-32b-class"],
)
def test_perf_md_reference_table(target_config, layer_ids, by_hand, target_tflop, drafter_tflop, samples_s, ktok_s):
    """The counter's reference workload equals the rules of docs/FLOPS.md worked by hand from the
    shapes, and docs/PERF.md's table (rounded) follows from them: one 2,826-token document per sample,
    layers up to the deepest feature layer, 512 anchors spread evenly over the whole document, 15
    labelled rows per anchor, every drafter linear inside the layers with an input gradient."""
    target = TargetShape.of(target_config)
    drafter = DrafterShape.of(build_drafter_config(target_config))
    assert drafter.target_layer_ids == layer_ids and drafter.block_size == 16 and drafter.num_layers == 5
    target_per_sample = reference_target_flops(target, drafter.target_layers_run)
    drafter_per_sample = reference_drafter_flops(drafter, mean_length=2826, num_anchors=512)
    assert (target_per_sample, drafter_per_sample) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand[0] / 1e12 == pytest.approx(target_tflop, rel=0.003)
    assert by_hand[1] / 1e12 == pytest.approx(drafter_tflop, rel=0.003)
    # The ceiling column: one H200 at 788 TFLOP/s doing both sides.
    ceiling = 788e12 / sum(by_hand)
    assert round(ceiling, 1) == samples_s
    assert round(ceiling * 2826 / 1e3, 1) == ktok_s


# ------------------------------------------------------------------ against torch's own FLOP counter


def _matmul_flops(run) -> int:
    """FLOPs of the matrix products ``run()`` executes (forward and backward), by torch.utils.flop_counter.
    Attention kernels are left out: the counter counts every (query, key) pair of a dense product,
    masked ones included, where docs/FLOPS.md counts visible pairs only; those are counted by hand."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run()
    ops = counter.get_flop_counts()["Global"]
    return int(sum(n for op, n in ops.items() if str(op) in ("aten.mm", "aten.addmm")))


def _documents(lengths, seed=0, prompt=2):
    from draftline.data.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    docs = [(torch.randint(0, 300, (n,), generator=g).tolist(), [i >= prompt for i in range(n)]) for n in lengths]
    return PackedBatch.from_documents(docs)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_target_flops_are_the_models_own_matmuls_plus_causal_pairs(family, qwen3_target, llama_target, tmp_path):
    """The counter's target FLOPs = the products the Hugging Face layers run on a packed batch (counted
    by torch) + 4 * heads * head_dim per causal pair inside each document, per layer run."""
    from helpers import make_qwen3_moe_target

    from draftline.model.target import TargetFeatures, load_target_config

    target_dir = {"qwen3": qwen3_target, "llama": llama_target}.get(family) or make_qwen3_moe_target(tmp_path / "moe")
    lengths = [9, 6, 17]
    batch = _documents(lengths)
    features = TargetFeatures(target_dir, [1, 3], dtype=torch.float32, packed=True)
    # Experts one by one as plain products: torch's counter does not count grouped ones (_grouped_mm).
    features.model.config._experts_implementation = "eager"
    with torch.no_grad():
        matmuls = _matmul_flops(lambda: features(batch))
    config = load_target_config(target_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    by_definition = matmuls + features.layers_run * 4 * config.num_attention_heads * head_dim * pairs
    assert target_flops(TargetShape.of(config), lengths, features.layers_run) == by_definition


def test_drafter_flops_are_the_steps_own_matmuls_plus_visible_pairs(qwen3_target):
    """One pass of the objective, forward and backward, dense attention on CPU: the counter's layers,
    context k/v, fc and LM head = the products torch counts; its attention = the visible pairs
    counted here slot by slot (each slot: the context of its document before its anchor, its block)."""
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config
    from draftline.sizing.flops import drafter_flops_of_blocks
    from draftline.objective.loss import DFlashObjective, ObjectiveSettings

    config = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4,
                                  target_layer_ids=[1, 3])
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float()
    embed, head = load_embedding_and_head(qwen3_target)
    objective = DFlashObjective(drafter, embed.float(), head.float(), ObjectiveSettings(max_anchors=3, attention="dense"))
    batch = _documents([19, 6, 12], seed=1)
    with torch.no_grad():
        features = TargetFeatures(qwen3_target, [1, 3], dtype=torch.float32)(batch)
    (part, blocks), = list(objective.passes(batch, 100, dense=True))

    def step():
        loss, _ = objective(features[part.token_lo:part.token_hi], blocks)
        loss.backward()

    matmuls = _matmul_flops(step)
    shape = DrafterShape.of(config)
    parts = drafter_flops_breakdown(shape, num_context_rows=blocks.layout.num_context,
                                    anchor_positions=blocks.layout.anchor_pos,
                                    num_labelled_rows=int(blocks.label_rows.shape[0]))
    assert parts["layers"] + parts["context_kv"] + parts["fc"] + parts["lm_head"] == matmuls
    visible = sum(1 for a in blocks.layout.anchor_pos.tolist() for _slot in range(4) for key in range(a + 4))
    assert parts["attention"] == 2 * 3 * 4 * config.num_attention_heads * config.head_dim * visible
    assert drafter_flops_of_blocks(shape, blocks) == sum(parts.values())


def test_mfu_arithmetic():
    assert mfu(788e12, 1.0, 788e12) == pytest.approx(1.0)
    assert mfu(8 * 394e12 * 2, 2.0, 788e12, num_gpus=8) == pytest.approx(0.5)
    assert math.isnan(mfu(1e12, 0.0, 788e12))
    with pytest.raises(ValueError):
        mfu(1e12, 1.0, 0.0)


def test_known_peak_is_the_spec_with_the_measured_ceiling_beside_it():
    h200 = known_peak("NVIDIA H200")
    assert (h200.flops, h200.ceiling) == (989e12, 788e12) and "spec dense bf16" in h200.source
    assert "matmul ceiling 788 TFLOP/s" in h200.describe()
    assert h200.of_ceiling(0.5) == pytest.approx(0.5 * 989 / 788)
    assert known_peak("NVIDIA H200 NVL").flops == 835e12 and known_peak("NVIDIA H200 NVL").ceiling is None
    assert known_peak("NVIDIA H100 80GB HBM3").flops == 989e12  # SXM
    assert known_peak("NVIDIA H100 PCIe").flops == 756e12
    assert known_peak("NVIDIA A100-SXM4-80GB").flops == 312e12 and known_peak("NVIDIA B200").flops == 2250e12
    assert gpu_spec("RTX PRO 6000") == gpu_spec("NVIDIA RTX PRO 6000 Blackwell Server Edition")
    # memory as torch reports it (the seeds' out-of-memory message), not the 96 GB sold
    assert (gpu_spec("RTX PRO 6000").bf16_flops, gpu_spec("RTX PRO 6000").memory_gib) == (504e12, 94.97)
    assert "94.97" in gpu_spec("RTX PRO 6000").memory_source and gpu_spec("H200").memory_gib == 139.81
    assert "datasheet" in gpu_spec("H200 NVL").memory_source
    assert known_peak("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition") is None  # other clocks
    assert known_peak("Some GPU") is None
    given = resolve_peak("cpu", override_flops=1e12)
    assert given.flops == 1e12 and "given" in given.describe()


def test_cpu_peak_is_quick():
    start = time.perf_counter()
    peak = resolve_peak("cpu")
    assert time.perf_counter() - start < 1.5
    assert peak.flops > 1e8 and "measured here" in peak.describe()
    assert not peak.for_mfu and peak.describe().startswith("no MFU")  # too unsteady to quote MFU against
    assert measure_peak_flops("cpu") > 1e8


@pytest.mark.gpu
def test_cuda_peak_is_measured():
    rate = measure_peak_flops("cuda", torch.bfloat16)
    assert rate > 1e12
    assert resolve_peak("cuda").flops > 1e12


def _hybrid(**extra):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=4, linear_num_key_heads=1,
                             linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                             linear_conv_kernel_dim=3, **extra)


def test_hybrid_layers_by_hand():
    shape = TargetShape.of(_hybrid())
    assert [layer.kind for layer in shape.layers] == ["linear_attention"] * 3 + ["full_attention"]
    linear, full = shape.layers[0], shape.layers[3]
    # Gated DeltaNet: qkv 8 -> 4+4+8, z 8 -> 8, a and b 8 -> 2 each, out 8 -> 8; SwiGLU 3 x 8 x 16.
    assert linear.mixer_params == 8 * 16 + 8 * 8 + 2 * 8 * 2 + 8 * 8 and linear.mlp_params == 384
    # Per token: weights, conv 2 x 3 taps x 16 channels, state 6 x dk x dv per value head.
    per_token = 2 * (linear.mixer_params + 384) + 2 * 3 * 16 + 6 * 2 * 4 * 4
    assert target_flops(shape, [5, 2], num_layers_run=1) == 7 * per_token
    # Gated full attention: q_proj also yields the output gate (2 x heads x head_dim columns).
    assert full.mixer_params == 8 * 16 + 2 * 8 * 4 + 8 * 8
    attention = 4 * 2 * 4 * (15 + 3)  # causal pairs of a 5- and a 2-token document
    assert target_flops(shape, [5, 2], 4) - target_flops(shape, [5, 2], 3) == 7 * 2 * (full.token_params) + attention


def test_linear_attention_is_linear_in_length_full_attention_is_not():
    shape = TargetShape.of(_hybrid())
    linear_only = shape.with_layers_run(3)
    assert target_flops(linear_only, [4000], 3) == 2 * target_flops(linear_only, [2000], 3)
    assert target_flops(linear_only, [4000], 3) == target_flops(linear_only, [1000] * 4, 3)  # packing changes nothing
    assert target_flops(shape, [4000], 4) > target_flops(shape, [1000] * 4, 4)  # the full layer is quadratic


def test_moe_counts_the_active_experts_shared_expert_and_router():
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig

    moe = Qwen3MoeConfig(hidden_size=8, intermediate_size=64, moe_intermediate_size=4, num_experts=6,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, vocab_size=10, mlp_only_layers=[1])
    layers = TargetShape.of(moe).layers
    assert layers[0].mlp_params == 2 * 3 * 8 * 4 + 8 * 6  # two experts run, plus the router
    assert layers[0].stored_mlp_params == 6 * 3 * 8 * 4 + 8 * 6  # all six sit in memory
    assert layers[1].mlp_params == 3 * 8 * 64  # a dense layer (mlp_only_layers)
    hybrid_moe = Qwen3_5MoeTextConfig(vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=4, linear_num_key_heads=1,
                                      linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                                      moe_intermediate_size=4, shared_expert_intermediate_size=12, num_experts=6,
                                      num_experts_per_tok=2)
    layer = TargetShape.of(hybrid_moe).layers[0]
    assert layer.mlp_params == 2 * 3 * 8 * 4 + 8 * 6 + 3 * 8 * 12 + 8  # + the shared expert and its gate


def test_sliding_target_layers_are_bounded_by_the_window():
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, vocab_size=10, sliding_window=4, use_sliding_window=True,
                         layer_types=["sliding_attention", "full_attention"])
    sliding = TargetShape.of(config).with_layers_run(1)
    weights = 2 * sliding.layers[0].token_params
    assert target_flops(sliding, [10], 1) == 10 * weights + 4 * 2 * 4 * (10 + 6 * 4)  # 1+2+3+4, then 4 each


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_a_dspark_pass_s_flops_are_its_own_matmuls_plus_visible_pairs(qwen3_target, head_type):
    """DSpark's pass, forward and backward (its head loss forms the gradients in its forward): the counter's
    backbone parts, the drafter's LM head on every labelled row (the anchor's slot drafts too), the Markov
    projection and the gate (``heads``) and the teacher's head on the target's final hidden state
    (``teacher_head``) = the products torch counts. The confidence head is a matrix-vector product, which torch's
    counter leaves out: 6 (H + r) per labelled row, added by hand."""
    import dataclasses

    from draftline.methods.dspark import DSpark
    from draftline.model.target import TargetFeatures, load_embedding_and_head, load_target_config
    from draftline.objective.loss import ObjectiveSettings
    from draftline.sizing.flops import drafter_flops_of_blocks

    method = DSpark(markov_rank=16, markov_head_type=head_type)
    config = method.build_config(build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2,
                                                      block_size=4, target_layer_ids=[1, 3]))
    torch.manual_seed(0)
    drafter = method.build_drafter(config).float()
    embed, head = load_embedding_and_head(qwen3_target)
    objective = method.objective(drafter, embed.float(), head.float(), ObjectiveSettings(max_anchors=3,
                                                                                         attention="dense"))
    batch = _documents([19, 6, 12], seed=1)
    with torch.no_grad():
        features = TargetFeatures(qwen3_target, [1, 3], dtype=torch.float32, final_hidden=True)(batch)
    (part, blocks), = list(objective.passes(batch, 100, dense=True))
    labelled = int(blocks.label_rows.shape[0])
    assert labelled > 3 * 3  # more than B - 1 per block: the anchor's slot has a label

    def step():
        loss, _ = objective(features[part.token_lo:part.token_hi], blocks)
        loss.backward()

    matmuls = _matmul_flops(step) + 6 * labelled * (config.hidden_size + 16)
    shape = dataclasses.replace(DrafterShape.of(config), method=method.shape(config))
    # Overlapping blocks share teacher rows: the teacher's head runs once per distinct row of a loss chunk.
    distinct = int(blocks.teacher.rows.shape[0])
    assert distinct < labelled
    parts = drafter_flops_breakdown(shape, num_context_rows=blocks.layout.num_context,
                                    anchor_positions=blocks.layout.anchor_pos, num_labelled_rows=labelled,
                                    num_teacher_rows=distinct)
    assert parts["heads"] + parts["teacher_head"] + sum(parts[k] for k in ("layers", "context_kv", "fc", "lm_head")) \
        == matmuls
    assert parts["teacher_head"] == 2 * distinct * config.hidden_size * config.vocab_size
    visible = sum(1 for a in blocks.layout.anchor_pos.tolist() for _slot in range(4) for key in range(a + 4))
    assert parts["attention"] == 2 * 3 * 4 * config.num_attention_heads * config.head_dim * visible
    assert drafter_flops_of_blocks(shape, blocks) == sum(parts.values())
    with pytest.raises(ValueError, match="exceeds anchors x drafted slots = 12"):
        drafter_flops_breakdown(shape, num_context_rows=10, anchor_positions=[3, 4, 5], num_labelled_rows=13)


def test_the_teacher_rows_estimate_counts_a_document_s_blocks_as_the_loss_chunks_them():
    """``plan`` and the reference workload estimate DSpark's distinct teacher rows from anchor positions alone: for
    one document whose every slot is labelled, the estimate is the blocks' own count, chunk by chunk; scaled to
    fewer labelled rows, it scales with them."""
    from draftline.data.batch import PackedBatch
    from draftline.objective.dspark_blocks import build_dspark_blocks
    from draftline.sizing.flops import estimated_teacher_rows

    batch = PackedBatch.from_documents([(list(range(64)), [True] * 64)], sample_ids=[0])
    anchors = torch.tensor([1, 2, 5, 9, 10, 11, 20, 30, 31, 40])
    for chunk in (3, 8, 1000):
        blocks = build_dspark_blocks(batch, anchors, block_size=4, mask_token_id=99, gamma=4.0, chunk_rows=chunk)
        labelled = int(blocks.label_rows.shape[0])
        assert labelled == 40  # every slot of every block
        exact = int(blocks.teacher.rows.shape[0])
        assert estimated_teacher_rows(anchors.double(), 4, labelled, chunk) == exact
        assert estimated_teacher_rows(anchors.double(), 4, labelled // 2, chunk) == round(exact / 2)
    assert exact < labelled  # overlapping blocks share rows
