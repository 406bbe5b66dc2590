import json
import shutil

import numpy as np
import pytest

from draftline.data.readers import MASK_MISMATCH, TEMPLATE_ERROR, SkipRecord
from draftline.data.template import ChatEncoder
from draftline.errors import DraftlineError

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, héllo 🙂"},
    {"role": "assistant", "content": "Yes: the model is ok 🙂."},
    {"role": "user", "content": "again?"},
    {"role": "assistant", "content": " two  three\n"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "def f(x):\n    return x"},
]


def _masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs, current = [], []
    for token, on in zip(ids.tolist(), mask.tolist()):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("thinking", [None, True, False])
def test_mask_is_exactly_the_assistant_turns_and_their_end_tokens(chat_target, thinking):
    encoder = ChatEncoder(chat_target, thinking=thinking)
    ids, mask = encoder.encode(MULTI_TURN)
    assert ids.dtype == np.int64 and mask.dtype == bool and len(ids) == len(mask)
    assert encoder.tokenizer.decode(ids.tolist()) == encoder.render(MULTI_TURN)  # tokens are the rendered text
    decoded = [encoder.tokenizer.decode(run) for run in _masked_runs(ids, mask)]
    assert decoded == [m["content"] + "<|im_end|>" for m in MULTI_TURN if m["role"] == "assistant"]
    # with thinking off the template puts an empty think block in the prompt, not in the mask
    assert ("<think>" in encoder.render(MULTI_TURN)) == (thinking is False)


def test_template_that_drops_or_rewrites_the_reply_is_a_mismatch(chat_target, tmp_path):
    target = tmp_path / "t"
    shutil.copytree(chat_target, target)
    template_path = target / "chat_template.jinja"

    def encode_with(template):
        template_path.write_text(template)
        return ChatEncoder(target).encode(MULTI_TURN)

    drops = "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    upper = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
    no_end = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.role != 'assistant' %}<|im_end|>{% endif %}\n{% endfor %}"
    for template in (drops, upper, no_end):
        with pytest.raises(SkipRecord) as info:
            encode_with(template)
        assert info.value.reason == MASK_MISMATCH
    refuses = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(SkipRecord) as info:
        encode_with(refuses)
    assert info.value.reason == TEMPLATE_ERROR and "alternate" in info.value.detail


def test_tokenizer_larger_than_the_target_vocabulary_stops(chat_target, tmp_path):
    target = tmp_path / "t"
    shutil.copytree(chat_target, target)
    config = json.loads((target / "config.json").read_text())
    config["vocab_size"] = 100
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlineError, match=r"tokenizer has \d+ tokens but config.json says vocab_size 100"):
        ChatEncoder(target)


def test_prompt_ids_end_with_the_generation_prompt(chat_target):
    encoder = ChatEncoder(chat_target, thinking=False)
    text = encoder.tokenizer.decode(encoder.prompt_ids(MULTI_TURN[:2]))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_closing_turns_with_a_token_other_than_eos_masks_up_to_that_token(chat_target, conversation,
                                                                                    write_jsonl, tmp_path, capsys):
    """ChatML's <|im_end|> closes the turns while the configs name another eos (<|endoftext|>): the closer is
    read from the template itself, so no record is blamed for the target's generation_config."""
    target = tmp_path / "t"
    shutil.copytree(chat_target, target)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        data = json.loads((target / name).read_text())
        if "eos_token_id" in data:
            data["eos_token_id"] = 0  # <|endoftext|>
        if "eos_token" in data:
            data["eos_token"] = "<|endoftext|>"
        (target / name).write_text(json.dumps(data))
    encoder = ChatEncoder(target)
    assert encoder.tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>" == encoder.tokenizer.eos_token
    assert encoder.end_of_turn == ["<|endoftext|>", "<|im_end|>"]
    ids, mask = encoder.encode(MULTI_TURN)
    decoded = [encoder.tokenizer.decode(run) for run in _masked_runs(ids, mask)]
    assert decoded == [m["content"] + "<|im_end|>" for m in MULTI_TURN if m["role"] == "assistant"]

    from draftline.cli import main

    source = write_jsonl(tmp_path / "chats.jsonl", [conversation(i) for i in range(6)])
    assert main(["prepare", "--target", str(target), "--input", source, "--out", str(tmp_path / "data")]) == 0
    printed = capsys.readouterr().out
    assert "skipped           0 (none)" in printed and "samples           6" in printed


def test_a_template_that_leaves_the_turn_open_has_no_closer_to_find(chat_target, tmp_path):
    """Only a special token right after the reply closes it: the next turn's opener is not taken for one."""
    target = tmp_path / "t"
    shutil.copytree(chat_target, target)
    (target / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.role != 'assistant' %}<|im_end|>"
        "{% endif %}\n{% endfor %}")
    assert ChatEncoder(target).end_of_turn == ["<|im_end|>"]  # the eos of the configs only
