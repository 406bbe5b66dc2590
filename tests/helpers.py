"""Test helpers: tiny random models built from configs (never downloads)."""

from __future__ import annotations

import torch

from draftline.sizing.workload import packed_batch


def make_qwen3_target(path, *, vocab_size=320, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, seed=0, tie=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie,
        initializer_range=0.2,
    )
    model = Qwen3ForCausalLM(config).float()
    model.save_pretrained(path)
    return path


def make_llama_target(path, *, vocab_size=300, hidden_size=48, num_layers=6, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


def layout_for(lengths, anchors_per_doc, block):
    """A BlockLayout for documents of ``lengths`` with the given anchor positions per document."""
    from draftline.model.attention import BlockLayout

    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    a_doc = torch.tensor([d for d, ps in enumerate(anchors_per_doc) for _ in ps])
    a_pos = torch.tensor([p for ps in anchors_per_doc for p in ps])
    return BlockLayout(doc, pos, a_doc, a_pos, block)


# Qwen3.5-style hybrid and MoE targets: 8 layers = 2 x (3 Gated DeltaNet + 1 gated full attention).
_HYBRID = dict(vocab_size=320, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
               initializer_range=0.2, tie_word_embeddings=False)
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def make_qwen3_5_target(path, *, seed=0, **overrides):
    """A tiny ``qwen3_5_text`` target (transformers' Qwen3_5ForCausalLM)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**_HYBRID, "intermediate_size": 128, **overrides})).float().save_pretrained(path)
    return path


def make_qwen3_5_moe_target(path, *, seed=0, **overrides):
    """A tiny ``qwen3_5_moe_text`` target: routed experts plus a shared expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**{**_HYBRID, **_MOE, "shared_expert_intermediate_size": 32, **overrides})
    Qwen3_5MoeForCausalLM(config).float().save_pretrained(path)
    return path


def make_qwen3_moe_target(path, *, seed=0, **overrides):
    """A tiny ``qwen3_moe`` target (full attention, routed experts)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, initializer_range=0.2, **_MOE), **overrides})
    Qwen3MoeForCausalLM(config).float().save_pretrained(path)
    return path


def make_qwen3_5_vl_target(path, *, seed=0):
    """A tiny vision-language checkpoint as Qwen3.5/3.6 ship: ``Qwen3_5ForConditionalGeneration``
    (``text_config``; ``model.language_model.*``, ``model.visual.*``) plus ``mtp.*`` weights."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(text_config={**_HYBRID, "intermediate_size": 128},
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=64))
    Qwen3_5ForConditionalGeneration(config).float().save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    weights["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(128, 64)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def tiny_drafter_worker(device, dtype, max_query_rows=2048, *, head_chunk_rows=4096, compile_layers=False,
                        max_bad_steps=20, total_steps=1000, max_anchors=512):
    """A drafter worker from the product's builder (2 layers, block 16, random frozen embedding and head) and a
    function ``delivery(seed, lengths=..., poison=False)`` that makes a batch of random features for it."""
    from transformers import Qwen3Config

    from draftline.config import TrainConfig
    from draftline.model.config import build_drafter_config
    from draftline.pipeline.build import build_drafter_worker
    from draftline.distributed.health import Health, local_rank_info
    from draftline.pipeline.spec import ModelSpec, RunSpec
    from draftline.pipeline.transport import Delivery

    target = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    cfg = build_drafter_config(target, num_hidden_layers=2, block_size=16, target_layer_ids=[1, 2])
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype) * 0.02
    config = TrainConfig()
    config.engine.max_query_rows = max_query_rows
    config.engine.head_chunk_rows = head_chunk_rows
    config.optim.max_bad_steps = max_bad_steps
    config.data.max_anchors = max_anchors
    spec = RunSpec.standalone(config, ModelSpec.from_configs(target, cfg), device, dtype=dtype, total_steps=total_steps)
    worker = build_drafter_worker(spec, Health(local_rank_info(0, "test", device)), embed=embed, head=head,
                                  compile_layers=compile_layers)
    width = spec.model.feature_width

    def delivery(seed, lengths=(700, 1300, 400, 900), poison=False):
        batch = packed_batch(list(lengths), cfg.vocab_size, seed, seed)
        features = torch.randn(batch.num_tokens, width, device=device, dtype=dtype)
        if poison:
            features[5, 3] = float("nan")
        return Delivery(seed, features, batch)

    return worker, delivery


class FakeDevice:
    """One CUDA device as memory.py reads it: its total, what its allocator has reserved, and what lies outside the
    allocator (context, libraries, other processes); the fraction memory.py sets is kept."""

    def __init__(self, monkeypatch, *, total, outside, reserved=0.0):
        self.total, self.outside, self.reserved, self.fraction = total, outside, reserved, 1.0
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (self.total - self.outside - self.reserved,
                                                                             self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self._set)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        from draftline.distributed import memory

        monkeypatch.setattr(memory, "_BUDGETS", {})  # no card left from another test

    def _set(self, fraction, index=None):
        assert 0 < fraction <= 1
        self.fraction = fraction

    @property
    def cap(self) -> float:
        return self.fraction * self.total


def tiny_target_config(*, vocab_size=64, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8):
    """A Qwen3 target config (never instantiated) for drafter-only tests."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                       head_dim=head_dim, max_position_embeddings=512,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_dspark_drafter(target_config=None, *, num_layers=2, block_size=4, markov_rank=8, markov_head_type="vanilla",
                        confidence_head=True, with_markov=True, target_layer_ids=(1, 3), seed=0, std=0.1):
    """A DSpark drafter (fp32, weights Normal(0, std)) for ``target_config`` (default ``tiny_target_config()``)."""
    from draftline.model.config import build_drafter_config
    from draftline.model.dspark import DSparkDrafter, build_dspark_config

    target_config = target_config or tiny_target_config()
    config = build_dspark_config(
        build_drafter_config(target_config, num_hidden_layers=num_layers, block_size=block_size,
                             target_layer_ids=list(target_layer_ids)),
        markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head=confidence_head,
        confidence_head_with_markov=with_markov)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config).float()
    drafter.reset_parameters(std=std)
    return drafter


def namespaces_work(tmp_path) -> bool:
    """Whether this machine lets a test mount a tiny tmpfs in a user namespace (a real full disk)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size=64k tmpfs {probe}"], capture_output=True)
    return done.returncode == 0


def edit_config(path, change):
    """Apply ``change`` (a function of the dict) to the drafter directory's config.json."""
    import json

    data = json.loads((path / "config.json").read_text())
    change(data)
    (path / "config.json").write_text(json.dumps(data))


def edit_tensors(path, change):
    """Apply ``change`` (tensors -> tensors, or None where it edits them in place) to model.safetensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file(change(tensors) or tensors, path / "model.safetensors")


def cuda_dspark_loss_inputs(seed: int, rows: int, hidden: int = 1024, vocab: int = 151936, rank: int = 256) -> dict:
    """DSpark head-loss inputs on CUDA at a real vocabulary: a bf16 head, a teacher near the drafter's rows."""
    torch.manual_seed(seed)
    device = "cuda"
    h = torch.randn(rows, hidden, device=device).bfloat16()
    return dict(hidden=h, latent=torch.randn(rows, rank, device=device) * 0.05,
                w2=torch.randn(vocab, rank, device=device) * 0.05,
                head_weight=(torch.randn(vocab, hidden, device=device) * 0.05).bfloat16(),
                labels=torch.randint(0, vocab, (rows,), device=device),
                teacher=(h.float() + 0.5 * torch.randn(rows, hidden, device=device)).bfloat16(),
                row_weights=torch.rand(rows, device=device))


def cuda_dspark_loss_run(inputs: dict, **kwargs) -> tuple:
    """(loss, ce, l1, accept, correct, gradients of hidden, latent and w2, bytes allocated at the peak above the
    start) of one ``dspark_head_loss`` call on ``cuda_dspark_loss_inputs``."""
    from draftline.objective.dspark_head_loss import dspark_head_loss

    leaves = {name: inputs[name].clone().requires_grad_(True) for name in ("hidden", "latent", "w2")}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    terms = dspark_head_loss(**{**inputs, **leaves}, **kwargs)
    grads = torch.autograd.grad(terms[0], list(leaves.values()))
    torch.cuda.synchronize()
    return (*terms, grads, torch.cuda.max_memory_allocated() - base)
