"""A tiny chat target for tests: a random Qwen3 model plus a real fast tokenizer with a chat template.

Everything is built in code (nothing downloaded): a byte-level BPE trained on a few KB of generated
text, so any string round-trips through encode/decode, and ChatML special tokens so the chat
template, the loss masks and generation behave like a real instruct model's.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

IM_START, IM_END, PAD, MASK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"

# Qwen3-like: roles in ChatML; with enable_thinking=false the generation prompt AND every assistant
# turn carry an empty think block, so the prompt stays a prefix of the rendered conversation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_WORDS = (
    "the a an of to in and or is are was be can will not you I we it this that with for on as at by "
    "from what how why when where which who model token draft target answer question user assistant "
    "system hello thanks please code python function return value list number data train batch loss "
    "speed fast slow good bad yes no one two three four five six seven eight nine ten think step "
    "because then so if else while print def class import error file line mask turn chat reply"
).split()


def _corpus(seed: int, num_chars: int = 6000) -> list[str]:
    rng = random.Random(seed)
    lines, size = [], 0
    while size < num_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]) + rng.choice(["", " 42", " (x)", "\n"])
        lines.append(line)
        size += len(line)
    return lines


def make_chat_tokenizer(*, seed: int = 0, bpe_vocab_size: int = 384):
    """A ``PreTrainedTokenizerFast`` with ChatML specials, a pad and a spare ``<|mask|>`` token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, IM_START, IM_END, MASK],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_chat_target(path, *, num_layers: int = 4, hidden_size: int = 64, seed: int = 0):
    """Save a tiny random Qwen3ForCausalLM (fp32) and its chat tokenizer to ``path``; return ``path``."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tokenizer = make_chat_tokenizer(seed=seed)
    num_heads = max(1, hidden_size // 16)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
