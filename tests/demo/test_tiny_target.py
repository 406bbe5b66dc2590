"""The shipped tiny target loads from the package, renders chats and predicts held-out code."""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path

import pytest
import torch

ASSETS = files("draftline.demo") / "assets"
TARGET = ASSETS / "tiny-target"
# Teacher-forced greedy next-token accuracy on the assistant turns of prompts.jsonl's first
# NUM_EVAL prompts, measured at training time (see assets/README.md), less a margin.
NUM_EVAL = 16
MIN_ACCURACY = 0.50  # measured 0.568 (torch 2.13 CPU, fp32)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts():
    with (ASSETS / "prompts.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_special_tokens_and_mask_row(target):
    model, tokenizer = target
    vocab_size = model.config.vocab_size
    assert vocab_size >= len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == vocab_size
    ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"])
    assert all(0 <= i < vocab_size for i in ids) and len(set(ids)) == 4
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert ids[1] in model.generation_config.eos_token_id


def test_chat_template_renders(target):
    _, tokenizer = target
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Continue this code:\n\nx = 1"},
                {"role": "assistant", "content": "y = 2"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nContinue this code:\n\nx = 1<|im_end|>\n"
                    "<|im_start|>assistant\ny = 2<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    # the prompt's tokens prefix the conversation's: "\n" never merges with what follows
    full_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert full_ids[:len(prompt_ids)] == prompt_ids


def test_heldout_accuracy_and_greedy_generation(target, prompts):
    model, tokenizer = target
    assert len(prompts) >= NUM_EVAL
    correct = count = 0
    with torch.no_grad():
        for conv in prompts[:NUM_EVAL]:
            prompt = tokenizer.apply_chat_template(conv["messages"][:1], tokenize=False, add_generation_prompt=True)
            prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            text = tokenizer.apply_chat_template(conv["messages"], tokenize=False)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:-1]])  # drop final "\n"
            predicted = model(input_ids=ids).logits[0, prompt_len - 1:-1].argmax(-1)
            correct += int((predicted == ids[0, prompt_len:]).sum())
            count += ids.shape[1] - prompt_len
    accuracy = correct / count
    assert accuracy > MIN_ACCURACY, f"held-out next-token accuracy {accuracy:.3f} <= {MIN_ACCURACY}"

    inputs = tokenizer.apply_chat_template(prompts[0]["messages"][:1], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(text.strip()) > 20 and "\n" in text, repr(text)


def test_the_script_uses_the_lines_lr_schedule():
    from draftline.demo.train_tiny_target import TinyTargetConfig, lr_at

    cfg = TinyTargetConfig(steps=200, warmup_steps=20, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 20)
    assert lr_at(19, cfg) == pytest.approx(1e-3)
    assert lr_at(110, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way down the cosine
    assert lr_at(200, cfg) == pytest.approx(1e-4)


def test_corpus_conversations_use_each_line_once():
    import random

    from draftline.demo.corpus import CorpusConfig, add_docstrings, file_conversations, is_heldout

    assert is_heldout("json/decoder.py", 10) == is_heldout("json/decoder.py", 10)
    text = "\n".join(f"x{i} = {i}" for i in range(300))
    item = {"path": "m.py", "text": text}
    add_docstrings([item])
    cfg = CorpusConfig(prompt_lines=(5, 10), response_lines=(5, 10))
    convs = file_conversations(item, cfg, random.Random(0))
    lines = [line for c in convs for m in c["messages"] for line in m["content"].splitlines() if line.startswith("x")]
    assert len(convs) > 10 and len(lines) == len(set(lines))


def test_the_corpus_reads_the_stdlib_s_sources_and_never_enters_test_or_site_packages_folders(tmp_path, monkeypatch):
    from draftline.demo.corpus import CorpusConfig, _stdlib_sources, collect_stdlib

    for rel in ["b.py", "a/z.py", "a/test_x.py", "a/notes.txt", "test/c.py", "a/tests/d.py", "site-packages/p/e.py",
                "a/__pycache__/f.py", "big.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * (1000 if rel == "big.py" else 1))
    entered = []
    real_walk = os.walk
    monkeypatch.setattr("draftline.demo.corpus.os.walk", lambda root: (entered.append(f) or (f, d, n)
                                                                       for f, d, n in real_walk(root)))
    assert [p.relative_to(tmp_path).as_posix() for p in _stdlib_sources(tmp_path)] == ["a/z.py", "b.py", "big.py"]
    assert not any(part in {"test", "tests", "site-packages", "__pycache__"} for f in entered
                   for part in Path(f).relative_to(tmp_path).parts)
    monkeypatch.setattr("draftline.demo.corpus.sysconfig.get_paths", lambda: {"stdlib": str(tmp_path)})
    files = collect_stdlib(CorpusConfig(max_file_bytes=1000))
    assert [f["path"] for f in files] == ["a/z.py", "b.py"] and files[1]["text"] == "x = 1\n"  # big.py: too large
