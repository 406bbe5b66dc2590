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
