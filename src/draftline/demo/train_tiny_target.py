"""Train the tiny target model that ships with ``draftline demo``.

The demo needs a target that predicts real text yet runs on any CPU, offline. This script makes one
from text every machine has, the Python standard library's source, in four steps:

    stdlib *.py --(sha256 of the relative path)--> train files | held-out files
    train files --> byte-level BPE tokenizer (ChatML tokens + <|mask|> for the DFlash drafter)
    train files --> chat conversations (user: code + instruction, assistant: the next lines)
                --> packed rows --> Qwen3ForCausalLM, a few MB
    held-out files --> conversations --> loss, next-token accuracy, prompts.jsonl for the demo

Run it with ``python -m draftline.demo.train_tiny_target --out DIR [--device cuda|cpu] [--steps N]``.
It writes ``DIR/tiny-target/`` (a Hugging Face model directory), ``DIR/prompts.jsonl`` and
``DIR/metrics.json``; ``--out src/draftline/demo/assets`` regenerates the shipped assets. Everything
random derives from ``--seed``. The stdlib differs between Python versions, so ``--data DIR`` caches
the corpus and the tokenizer: prepare them once (``--prepare-only``) and train from the cache on
another machine to get the same text and token ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import multiprocessing
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftline.cores import usable_cores
from draftline.demo.corpus import CorpusConfig, add_docstrings, build_conversations, collect_stdlib
from draftline.pipeline.optim import lr_factor

END_OF_TEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TinyTargetConfig:
    seed: int = 0
    """Seed for the split-independent randomness: conversations, row order, initial weights."""
    heldout_percent: int = 10
    """Files whose sha256(relative path) mod 100 falls below this are held out (never trained on)."""
    max_file_bytes: int = 400_000
    """Larger files are generated data (pydoc_data/topics.py), not code; they are skipped."""
    vocab_size: int = 2048
    """Tokenizer size, special tokens included; also the model's vocab_size (a multiple of 64)."""
    hidden_size: int = 256
    """Width of the residual stream and of the (tied) embedding."""
    num_layers: int = 6
    """Decoder layers. Six leave room for distinct DFlash feature layers (ids 1..L-2)."""
    num_heads: int = 4
    """Query heads of head_dim each."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 64
    """Per-head width."""
    intermediate_size: int = 512
    """SwiGLU width; with the sizes above the bf16 weights stay near 8 MB."""
    max_position_embeddings: int = 2048
    """Longest sequence the model is meant for (RoPE has no hard limit)."""
    prompt_lines: tuple[int, int] = (10, 30)
    """Range (inclusive) of code lines in a user turn."""
    response_lines: tuple[int, int] = (20, 40)
    """Range (inclusive) of code lines in an assistant turn."""
    max_turn_chars: int = 2000
    """A turn longer than this loses lines from its far end (keeps data-table files in check)."""
    seq_len: int = 1024
    """Tokens per packed training row."""
    batch_size: int = 32
    """Rows per optimizer step."""
    steps: int = 1100
    """Optimizer steps."""
    lr: float = 3e-3
    """Peak AdamW learning rate; linear warmup then cosine to lr * min_lr_ratio."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    eval_every: int = 100
    """Steps between held-out evaluations (the weights with the lowest held-out loss are kept)."""
    num_prompts: int = 200
    """Held-out conversations written to prompts.jsonl for the demo."""
    max_prompt_tokens: int = 1024
    """prompts.jsonl takes only held-out conversations of at most this many tokens."""
    eval_limit: int = 0
    """Evaluate on at most this many held-out conversations (0: all of them)."""

    def corpus(self) -> CorpusConfig:
        """The fields that decide which text becomes which conversation."""
        return CorpusConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CorpusConfig)})

    def validate(self) -> None:
        if self.vocab_size % 64 or self.vocab_size < 512:
            raise ValueError(f"vocab_size={self.vocab_size}: use a multiple of 64, at least 512")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout_percent={self.heldout_percent}: pick a value in 1..99")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len} exceeds max_position_embeddings={self.max_position_embeddings}")


# --------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE with ChatML tokens and the drafter's mask token


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Every "\n" is a token of its own: otherwise "\n" merges with the next line's indentation, and
    # the "\n" that ends "<|im_start|>assistant\n" would tokenize differently in a prompt (alone)
    # and in training text (merged), a mismatch the model would meet on every generation.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=END_OF_TEXT,
                                   additional_special_tokens=[IM_START, MASK], model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def prepare_data(cfg: TinyTargetConfig, data_dir: Path | None):
    """Corpus and tokenizer, read from data_dir when it holds them, else built (and cached there)."""
    from tokenizers import Tokenizer

    if data_dir is not None and (data_dir / "corpus.jsonl.gz").is_file():
        with gzip.open(data_dir / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
            files = [json.loads(line) for line in f]
        tokenizer = wrap_tokenizer(Tokenizer.from_file(str(data_dir / "tokenizer.json")))
        source = json.loads((data_dir / "source.json").read_text())
        print(f"data: read {len(files)} files from {data_dir} (stdlib of Python {source['python']})")
        return files, tokenizer, source
    files = collect_stdlib(cfg.corpus())
    tokenizer = train_tokenizer([f["text"] for f in files if f["split"] == "train"], cfg.vocab_size)
    source = {"python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"]}
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        # mtime=0 keeps the cached corpus byte-identical between runs
        with open(data_dir / "corpus.jsonl.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for item in files:
                f.write((json.dumps(item) + "\n").encode())
        tokenizer.backend_tokenizer.save(str(data_dir / "tokenizer.json"))
        (data_dir / "source.json").write_text(json.dumps(source))
    print(f"data: built from the stdlib of Python {source['python']}: {len(files)} files")
    return files, tokenizer, source


def render(tokenizer, conv: dict) -> str:
    return tokenizer.apply_chat_template(conv["messages"], tokenize=False)


class LineEncoder:
    """Tokenizes rendered conversations line by line, each distinct line once.

    Exact, because the pre-tokenizer isolates every "\\n" and special tokens split text before it:
    no token spans a line break, so a text's ids are its lines' ids joined by the "\\n" id. Re-tokenizing
    every epoch's text instead costs ~20 s of CPU per epoch; this makes an epoch a few seconds of joins.
    """

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer = tokenizer
        self.special = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        self.newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        lines = sorted({line for text in texts for line in text.split("\n")} | {"user", "assistant"})
        ids = tokenizer(lines, add_special_tokens=False)["input_ids"]
        self.cache = dict(zip(lines, ids))

    def line(self, line: str) -> list[int]:
        ids = self.cache.get(line)
        if ids is None:
            ids = self.cache[line] = self.tokenizer(line, add_special_tokens=False)["input_ids"]
        return ids

    def text(self, text: str) -> list[int]:
        out = []
        for i, line in enumerate(text.split("\n")):
            if i:
                out += self.newline
            out += self.line(line)
        return out

    def conversation(self, conv: dict) -> list[int]:
        """The ids of render(tokenizer, conv), as CHAT_TEMPLATE lays it out."""
        out = []
        for message in conv["messages"]:
            out += [self.special[IM_START], *self.line(message["role"]), *self.newline]
            out += [*self.text(message["content"]), self.special[IM_END], *self.newline]
        return out


def training_rows(files: list[dict], encoder: LineEncoder, cfg: TinyTargetConfig, epoch: int) -> torch.Tensor:
    """One epoch of packed rows [N, seq_len + 1] (int16): conversations, shuffled, joined by <|endoftext|>."""
    convs = build_conversations(files, cfg.corpus(), seed=cfg.seed * 1_000_003 + epoch)
    random.Random(cfg.seed + epoch).shuffle(convs)
    eot = encoder.special[END_OF_TEXT]
    stream = torch.tensor([t for conv in convs for t in (*encoder.conversation(conv), eot)], dtype=torch.int16)
    num_rows = len(stream) // (cfg.seq_len + 1)
    return stream[: num_rows * (cfg.seq_len + 1)].view(num_rows, cfg.seq_len + 1)


_POOL_STATE: tuple | None = None


def _rows_in_worker(epoch: int) -> torch.Tensor:
    return training_rows(*_POOL_STATE[:2], _POOL_STATE[2], epoch)


def all_training_rows(files: list[dict], encoder: LineEncoder, cfg: TinyTargetConfig) -> list[torch.Tensor]:
    """Every epoch the run needs, built up front in forked worker processes (pure Python, GIL-bound)."""
    global _POOL_STATE
    first = training_rows(files, encoder, cfg, 0)
    # one spare epoch: a later epoch may hold a few rows fewer than the first
    num_epochs = math.ceil(cfg.steps / (first.shape[0] // cfg.batch_size)) + 1
    print(f"data: {first.numel() / 1e6:.2f}M tokens per epoch ({first.shape[0]} rows of {cfg.seq_len + 1}); "
          f"{cfg.steps} steps take {num_epochs} epochs")
    _POOL_STATE = (files, encoder, cfg)
    workers = max(1, min(num_epochs - 1, usable_cores() - 1))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return [first, *pool.map(_rows_in_worker, range(1, num_epochs))]


def batches(epochs: list[torch.Tensor], cfg: TinyTargetConfig):
    for epoch, rows in enumerate(epochs):
        for start in range(0, rows.shape[0] - cfg.batch_size + 1, cfg.batch_size):
            yield epoch, rows[start:start + cfg.batch_size].long()


# --------------------------------------------------------------------------------------------------
# Model


def build_model(cfg: TinyTargetConfig, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens; vocab_size={cfg.vocab_size} is too small")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids[END_OF_TEXT], eos_token_id=ids[IM_END], pad_token_id=ids[END_OF_TEXT],
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config)


def lr_at(step: int, cfg: TinyTargetConfig) -> float:
    """The training line's schedule (``pipeline.optim.lr_factor``): linear warmup, then cosine."""
    return cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)


@torch.no_grad()
def evaluate(model, tokenizer, convs: list[dict], device, batch_size: int = 32) -> dict:
    """Loss and greedy next-token accuracy over the assistant turns (content and <|im_end|>)."""
    model.eval()
    examples = []
    for conv in convs:
        prompt = tokenizer.apply_chat_template(conv["messages"][:-1], add_generation_prompt=True, tokenize=False)
        full = render(tokenizer, conv)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][:-1]  # drop the template's final "\n"
        assert ids[:len(prompt_ids)] == prompt_ids, "prompt tokens must prefix the conversation's tokens"
        examples.append((ids, len(prompt_ids)))
    examples.sort(key=lambda e: len(e[0]))
    total_loss, total_correct, total_count = 0.0, 0, 0
    pad = tokenizer.pad_token_id
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for i, (ids, prompt_len) in enumerate(chunk):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, prompt_len - 1:len(ids) - 1] = torch.tensor(ids[prompt_len:])
        input_ids, labels = input_ids.to(device), labels.to(device)
        # right padding needs no attention mask: causal attention never looks right
        logits = model(input_ids=input_ids).logits.float()
        valid = labels != -100
        total_loss += F.cross_entropy(logits[valid], labels[valid], reduction="sum").item()
        total_correct += (logits[valid].argmax(-1) == labels[valid]).sum().item()
        total_count += int(valid.sum())
    model.train()
    loss = total_loss / total_count
    return {"loss": loss, "perplexity": math.exp(loss), "next_token_accuracy": total_correct / total_count,
            "num_tokens": total_count, "num_conversations": len(convs)}


def greedy_sample(model, tokenizer, conv: dict, device, max_new_tokens: int = 96) -> str:
    ids = tokenizer.apply_chat_template(conv["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(device)
    model.eval()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    model.train()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def save(model, tokenizer, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    from transformers import GenerationConfig

    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    model.generation_config = GenerationConfig(bos_token_id=eos[1], eos_token_id=eos, pad_token_id=eos[1],
                                               do_sample=False, max_new_tokens=512)
    model.to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    model.float()


# --------------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv=None) -> tuple[argparse.Namespace, TinyTargetConfig]:
    p = argparse.ArgumentParser(prog="python -m draftline.demo.train_tiny_target", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="writes OUT/tiny-target/, OUT/prompts.jsonl, OUT/metrics.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", type=Path, help="cache of the corpus and tokenizer (read if present, else written)")
    p.add_argument("--prepare-only", action="store_true", help="build the --data cache and stop")
    for field in dataclasses.fields(TinyTargetConfig):
        if field.type in ("int", "float"):
            p.add_argument(f"--{field.name.replace('_', '-')}", type=int if field.type == "int" else float,
                           default=field.default)
    args = p.parse_args(argv)
    if args.out is None and not args.prepare_only:
        p.error("--out is required (unless --prepare-only)")
    if args.prepare_only and args.data is None:
        p.error("--prepare-only needs --data")
    cfg = TinyTargetConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyTargetConfig)
                              if hasattr(args, f.name)})
    cfg.validate()
    return args, cfg


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    device = torch.device(args.device)
    random.seed(cfg.seed)
    t0 = time.time()

    # ---- data
    files, tokenizer, source = prepare_data(cfg, args.data)
    add_docstrings(files)
    train_files = [f for f in files if f["split"] == "train"]
    heldout_files = [f for f in files if f["split"] == "heldout"]
    print(f"data: {len(train_files)} train files, {len(heldout_files)} held-out; tokenizer {len(tokenizer)} tokens "
          f"(mask {MASK} = {tokenizer.convert_tokens_to_ids(MASK)}), {time.time() - t0:.0f}s")
    if args.prepare_only:
        return
    heldout = build_conversations(heldout_files, cfg.corpus(), seed=cfg.seed + 12345)
    # the demo regenerates responses from these prompts: keep them well inside the context
    short = [c for c in heldout if len(tokenizer(render(tokenizer, c))["input_ids"]) <= cfg.max_prompt_tokens]
    prompts = random.Random(cfg.seed).sample(short, min(cfg.num_prompts, len(short)))
    eval_convs = heldout[: cfg.eval_limit] if cfg.eval_limit else heldout

    # built before the model touches CUDA: the epochs come from forked processes
    encoder = LineEncoder(tokenizer, [f["text"] for f in train_files])
    sample_convs = build_conversations(train_files[:20], cfg.corpus(), seed=0)
    if any(encoder.conversation(c) != tokenizer(render(tokenizer, c), add_special_tokens=False)["input_ids"]
           for c in sample_convs):
        raise RuntimeError("LineEncoder disagrees with the tokenizer; was the pre-tokenizer changed?")
    epochs = all_training_rows(train_files, encoder, cfg)

    # ---- model and optimizer
    model = build_model(cfg, tokenizer).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len
    print(f"model: {num_params / 1e6:.2f}M parameters ({num_params * 2 / 2**20:.1f} MiB in bf16); "
          f"{tokens_per_step} tokens per step, {cfg.steps} steps = {cfg.steps * tokens_per_step / 1e6:.0f}M tokens")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), fused=fused)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    # ---- train
    history, evals, best = [], [], None
    data = batches(epochs, cfg)
    t_train = time.time()
    for step in range(cfg.steps):
        epoch, rows = next(data)
        rows = rows.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with autocast:
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = step == cfg.steps - 1
        if step % 25 == 0 or last:
            # .item() syncs with the GPU; only every 25 steps
            history.append({"step": step, "epoch": epoch, "loss": loss.item(), "grad_norm": grad_norm.item()})
            elapsed = time.time() - t_train
            eta = elapsed / (step + 1) * (cfg.steps - step - 1)
            print(f"step {step:5d} epoch {epoch} loss {history[-1]['loss']:.4f} lr {lr_at(step, cfg):.2e} "
                  f"{(step + 1) * tokens_per_step / elapsed / 1e3:.0f}K tok/s eta {eta:.0f}s", flush=True)
        if (step + 1) % cfg.eval_every == 0 or last:
            with autocast:
                result = evaluate(model, tokenizer, eval_convs, device)
            evals.append({"step": step + 1, **result})
            print(f"eval step {step + 1}: held-out loss {result['loss']:.4f} "
                  f"next-token accuracy {result['next_token_accuracy']:.4f}", flush=True)
            if best is None or result["loss"] < best[0]["loss"]:
                best = ({"step": step + 1, **result}, {k: v.detach().clone() for k, v in model.state_dict().items()})
    train_seconds = time.time() - t_train

    # ---- save the best weights and measure what ships (bf16 weights, fp32 compute)
    model.load_state_dict(best[1])
    target_dir = args.out / "tiny-target"
    save(model, tokenizer, target_dir)
    from transformers import AutoModelForCausalLM

    shipped = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    final = evaluate(shipped, tokenizer, eval_convs, device)
    on_prompts = evaluate(shipped, tokenizer, prompts, device)
    sample = greedy_sample(shipped, tokenizer, prompts[0], device)
    print(f"final (bf16 weights, fp32 compute): held-out loss {final['loss']:.4f} ppl {final['perplexity']:.2f} "
          f"next-token accuracy {final['next_token_accuracy']:.4f}; on prompts.jsonl "
          f"{on_prompts['next_token_accuracy']:.4f}")
    print("sample:", prompts[0]["source"], "\n" + sample)

    with open(args.out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i, conv in enumerate(prompts):
            f.write(json.dumps({"id": i, **conv}) + "\n")
    metrics = {
        "config": dataclasses.asdict(cfg), "argv": sys.argv[1:] if argv is None else argv, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "corpus": {**source, "train_files": len(train_files), "heldout_files": len(heldout_files),
                   "heldout_conversations": len(heldout), "eval_conversations": len(eval_convs)},
        "num_parameters": num_params, "train_seconds": train_seconds, "best": best[0],
        "final_heldout": final, "final_prompts": on_prompts, "sample": {"source": prompts[0]["source"], "text": sample},
        "evals": evals, "history": history,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"wrote {target_dir}, {args.out / 'prompts.jsonl'}, {args.out / 'metrics.json'} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
