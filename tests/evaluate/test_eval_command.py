"""``draftline eval`` end to end on CPU: prompts as ids and as chat messages, JSON output, errors."""

from __future__ import annotations

import json

import pytest
import torch

from chat_target import make_chat_target
from draftline.checkpoint.export import save_drafter
from draftline.cli import main
from draftline.data.template import ChatEncoder
from draftline.evaluate.speculative import target_generate


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A chat target and a run directory whose final/ holds a drafter for it."""
    from draftline.model.config import build_drafter_config
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import load_target_config

    root = tmp_path_factory.mktemp("eval_cli")
    target_dir = make_chat_target(root / "target", num_layers=4)
    config = build_drafter_config(load_target_config(target_dir), num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(config).float(), root / "run" / "final", dtype=torch.float32)
    return target_dir, root / "run"


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_eval_with_ids_and_messages(chat_run, tmp_path, capsys):
    target_dir, run_dir = chat_run
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "What is a draft model?"},
                {"role": "assistant", "content": "A small model."}]  # the reply is cut: the prompt ends before it
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"input_ids": [5, 6, 7, 8]}, "", {"messages": messages},
                                                       {"input_ids": [9, 9]}])
    out = tmp_path / "out.json"
    code = main(["eval", "--target", str(target_dir), "--drafter", str(run_dir), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--limit", "2", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tau " in printed and "P(slot k accepted)" in printed and str(out) in printed

    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2 and len(result["per_prompt"]) == 2  # --limit
    assert result["block_size"] == 4 and len(result["acceptance_hist"]) == 4 and 1 <= result["tau"] <= 4
    chat_ids = ChatEncoder(target_dir).prompt_ids(messages[:2])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    for prompt, entry in zip([[5, 6, 7, 8], chat_ids], result["per_prompt"]):
        assert entry["output_ids"][: len(prompt)] == prompt
        assert entry["output_ids"] == target_generate(model, prompt, max_new_tokens=12, stop_token_ids=[eos]).output_ids
        assert sum(entry["acceptance_lengths"]) == len(entry["output_ids"]) - len(prompt) - 1


def test_eval_sampled(chat_run, tmp_path):
    target_dir, run_dir = chat_run
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7, 8]}])
    out = tmp_path / "out.json"
    args = ["eval", "--target", str(target_dir), "--drafter", str(run_dir / "final"), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--temperature", "0.9", "--top-p", "0.95", "--top-k", "20",
            "--block-size", "3", "--stop-token-ids", "none", "--json", str(out)]
    assert main(args) == 0
    first = json.loads(out.read_text())
    assert main(args) == 0
    again = json.loads(out.read_text())["per_prompt"][0]
    assert again["output_ids"] == first["per_prompt"][0]["output_ids"]  # seeded
    assert again["acceptance_lengths"] == first["per_prompt"][0]["acceptance_lengths"]
    assert len(first["per_prompt"][0]["output_ids"]) == 4 + 8 and first["temperature"] == 0.9


@pytest.mark.parametrize("line,message", [
    ('{"input_ids": [1, 2', "prompts.jsonl:2: malformed JSON"),
    ('{"text": "hi"}', "prompts.jsonl:2: neither input_ids nor messages"),
    ('{"input_ids": [1, 99999]}', "prompts.jsonl:2: token id 99999 is outside"),
    ('{"messages": [{"role": "user", "content": ""}]}', "prompts.jsonl:2:"),
])
def test_bad_prompt_lines_name_file_and_line(chat_run, tmp_path, capsys, line, message):
    target_dir, run_dir = chat_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"input_ids": [1, 2]}, line])
    code = main(["eval", "--target", str(target_dir), "--drafter", str(run_dir), "--prompts", str(prompts)])
    assert code == 2 and message in capsys.readouterr().err


def test_drafter_for_another_target_is_refused(chat_run, qwen3_target, tmp_path, capsys):
    _, run_dir = chat_run
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2]}])
    code = main(["eval", "--target", str(qwen3_target), "--drafter", str(run_dir), "--prompts", str(prompts)])
    err = capsys.readouterr().err
    assert code == 2 and "does not match the target" in err and "vocab_size" in err


def test_eval_against_an_fp8_target_decodes_as_that_target(chat_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftline.model.target import convert_to_fp8

    target_dir, run_dir = chat_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 9, 4]}])
    out = tmp_path / "out.json"
    assert main(["eval", "--target", str(target_dir), "--drafter", str(run_dir), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--target-fp8", "--json", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id

    def greedy():
        return [target_generate(model, p, max_new_tokens=12, stop_token_ids=[eos]).output_ids
                for p in ([5, 6, 7, 8], [9, 9, 4])]

    plain = greedy()
    convert_to_fp8(model)
    fp8 = greedy()
    assert fp8 != plain  # the prompts tell the two targets apart, so an ignored flag would fail below
    assert [entry["output_ids"] for entry in json.loads(out.read_text())["per_prompt"]] == fp8  # lossless for it
