"""The benchmarks' shared workloads: model shapes (random weights built from a config), the length mix and
packed batches (the product's reference workload, ``draftline.sizing.workload``), and drafter workers from the
product's one builder. Every bench script imports these from here; nothing here imports a bench script."""

from __future__ import annotations

import gc
import statistics

import torch

from draftline.config import TrainConfig
from draftline.sizing.peak import gpu_spec
from draftline.sizing.workload import lognormal_lengths, packed_batch  # noqa: F401  (the scripts import them from here)
from draftline.pipeline.build import build_drafter_worker
from draftline.distributed.health import Health, local_rank_info
from draftline.pipeline.spec import ModelSpec, RunSpec
from draftline.methods import method_for

HYBRID_SHAPES = {
    # Qwen3.5-27B / Qwen3.6-27B text stack.
    "27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                intermediate_size=17408, vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "tiny": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=1000, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4),
}


def hybrid_config(shape: str):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**HYBRID_SHAPES[shape], max_position_embeddings=262144, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                              "partial_rotary_factor": 0.25})



SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936),
    "32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                intermediate_size=25600, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144, vocab_size=151936),
    "tiny": dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=1000),
}


HYBRID = {"27b-hybrid": "27b", "tiny-hybrid": "tiny"}  # Qwen3.5/3.6 text stacks: HYBRID_SHAPES


def target_config(shape: str):
    if shape in HYBRID:
        return hybrid_config(HYBRID[shape])
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def random_target(shape: str, device: torch.device, dtype: torch.dtype, attn: str):
    """All layers of the shape's model, random weights, built on ``device`` in ``dtype``."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    config = target_config(shape)
    config._attn_implementation = attn
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Qwen3_5ForCausalLM if shape in HYBRID else Qwen3ForCausalLM)(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model


def spec_peak(device) -> float:
    """The GPU's spec dense bf16 peak (the package's table), NaN off CUDA or for an unknown GPU."""
    spec = gpu_spec(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return spec.bf16_flops if spec else float("nan")


def reserved_gib(device) -> float:
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else float("nan")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, iters: int, warmup: int = 1) -> float:
    """Median milliseconds of ``fn`` on the current CUDA device over ``iters`` calls (CUDA events, each call synced),
    after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device):
    gc.collect()  # modules and hooks form cycles: free the previous row's model before measuring
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def make_worker(cfg, device, dtype, max_query_rows, embed, head, head_chunk_rows=4096, compile_layers=True,
                attention="auto", recompute="cheap", moments="fp32"):
    """A drafter worker from the product's one builder, for a drafter config alone and random frozen weights."""
    config = TrainConfig()
    config.engine.max_query_rows = max_query_rows
    config.engine.head_chunk_rows = head_chunk_rows
    config.engine.attention = attention
    config.engine.compile = compile_layers
    config.engine.recompute = recompute
    config.optim.moments = moments
    config.optim.max_bad_steps = 10**6
    config.model.method = method_for(cfg).name  # the objective's loss follows the drafter's method
    spec = RunSpec.standalone(config, ModelSpec.from_configs(None, cfg), device, dtype=dtype, total_steps=1000)
    return build_drafter_worker(spec, Health(local_rank_info(0, "bench", device)), embed=embed, head=head)


def train_step(worker, delivery) -> None:
    """One step as the drafter's loop runs it: the step's passes, the record of the step before (read one step
    late), the step's update queued."""
    worker.accumulate([delivery])
    worker.read_record()
    worker.queue_update()


def environment(*packages: str) -> dict:
    """The versions a measurement ran with: torch, Python, ``packages`` (None where absent), the GPU and its
    capacity as torch reports it."""
    import importlib.metadata as md
    import sys

    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for pkg in ("transformers", "triton", *packages):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["device_total_gib"] = torch.cuda.mem_get_info()[1] / 2**30
    return env
