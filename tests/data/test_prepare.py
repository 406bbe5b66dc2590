import json

import numpy as np
import pytest

from draftline.cli import main
from draftline.data.dataset import FORMAT_VERSION, TokenDataset
from draftline.data.prepare import PrepareConfig, prepare
from draftline.data.template import ChatEncoder
from draftline.errors import DraftlineError

BAD_RECORDS = [
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]}, "empty_content"),
    ({"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown_role"),
    ({"text": "no conversation here"}, "unrecognised_record"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, "no_trained_tokens"),
]


@pytest.fixture
def mixed_input(tmp_path, conversation, write_jsonl):
    records = [conversation(i) for i in range(40)] + [r for r, _ in BAD_RECORDS] + [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}]
    return write_jsonl(tmp_path / "mixed.jsonl", records)


def _config(target, inputs, out, **kwargs):
    return PrepareConfig(target=target, inputs=inputs, out=out, progress=False, **kwargs)


def test_every_record_is_a_sample_a_heldout_prompt_or_a_counted_skip(chat_target, mixed_input, tmp_path):
    meta = prepare(_config(chat_target, [mixed_input], tmp_path / "ds", heldout=3, seed=1))
    assert meta["skipped"] == {reason: 1 for _, reason in BAD_RECORDS}
    assert meta["num_records"] == 46 and meta["num_heldout"] == 3 and meta["num_samples"] == 38
    assert meta["format_version"] == FORMAT_VERSION and meta["target_vocab_size"] == len(ChatEncoder(chat_target).tokenizer)

    ds = TokenDataset(tmp_path / "ds")
    assert len(ds) == 38 and ds.lengths.sum() == meta["num_tokens"]
    encoder = ChatEncoder(chat_target)
    rendered = {encoder.tokenizer.decode(ds[i][0].tolist()) for i in range(len(ds))}
    heldout = ds.heldout()
    assert len(heldout) == 3
    for prompt in heldout:  # a prompt up to the first assistant turn, and nowhere in the training arrays
        assert [m["role"] for m in prompt["messages"]] == ["system", "user"]
        assert prompt["input_ids"] == encoder.prompt_ids(prompt["messages"])
        assert not any(prompt["messages"][1]["content"] + "<|im_end|>" in text for text in rendered)
    # deterministic from the seed, different for another seed
    again = prepare(_config(chat_target, [mixed_input], tmp_path / "ds2", heldout=3, seed=1))
    other = prepare(_config(chat_target, [mixed_input], tmp_path / "ds3", heldout=3, seed=2))
    assert TokenDataset(tmp_path / "ds2").heldout() == heldout != TokenDataset(tmp_path / "ds3").heldout()
    assert again["num_tokens"] == meta["num_tokens"] and other["num_heldout"] == 3


def test_round_trip_and_packed_batch(chat_target, conversation, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i, turns=1 + i % 3) for i in range(12)])
    prepare(_config(chat_target, [path], tmp_path / "ds"))
    ds = TokenDataset(tmp_path / "ds")
    encoder = ChatEncoder(chat_target)
    for i in range(len(ds)):
        ids, mask = encoder.encode(conversation(i, turns=1 + i % 3)["messages"][:])
        got_ids, got_mask = ds[i]
        assert got_ids.dtype == np.int64 and got_mask.dtype == bool
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask, mask)
    batch = ds.packed_batch([3, 0, 7], epoch=2, index=11)
    assert batch.sample_ids.tolist() == [3, 0, 7] and batch.epoch == 2 and batch.index == 11
    assert batch.doc_lengths.tolist() == [len(ds[i][0]) for i in (3, 0, 7)]
    np.testing.assert_array_equal(batch.input_ids.numpy(), np.concatenate([ds[i][0] for i in (3, 0, 7)]))
    np.testing.assert_array_equal(batch.loss_mask.numpy(), np.concatenate([ds[i][1] for i in (3, 0, 7)]))


def test_workers_give_the_same_dataset(chat_target, mixed_input, tmp_path):
    one = prepare(_config(chat_target, [mixed_input], tmp_path / "one", heldout=2))
    two = prepare(_config(chat_target, [mixed_input], tmp_path / "two", heldout=2, workers=2))
    for name in ("tokens.bin", "loss_mask.bin", "index.npy", "heldout.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert one["skipped"] == two["skipped"]


def test_strict_stops_at_the_first_skip_naming_file_and_line(chat_target, mixed_input, tmp_path):
    with pytest.raises(DraftlineError, match=r"mixed\.jsonl:41: no assistant turn .*--strict"):
        prepare(_config(chat_target, [mixed_input], tmp_path / "ds", strict=True))
    assert not (tmp_path / "ds").exists()  # a failed prepare leaves nothing half-written


def test_overlong_truncate_or_drop(chat_target, conversation, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i, turns=3) for i in range(6)])
    full = prepare(_config(chat_target, [path], tmp_path / "full"))
    limit = int(np.median(TokenDataset(tmp_path / "full").lengths))
    cut = prepare(_config(chat_target, [path], tmp_path / "cut", max_length=limit))
    dropped = prepare(_config(chat_target, [path], tmp_path / "drop", max_length=limit, overlong="drop"))
    longer = int((TokenDataset(tmp_path / "full").lengths > limit).sum())
    assert cut["num_samples"] == 6 and cut["stats"]["max_length"] == limit and cut["num_truncated"] == longer
    assert dropped["num_samples"] == 6 - longer and dropped["skipped"] == {"overlong": longer}
    assert full["num_samples"] == 6


def test_pretokenized_ids_outside_the_vocabulary_stop(chat_target, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 10**6], "loss_mask": [0, 1]}])
    with pytest.raises(DraftlineError, match=r"t\.jsonl:1: token id 1000000 outside the target's vocabulary"):
        prepare(_config(chat_target, [path], tmp_path / "ds"))


def test_dataset_errors_name_the_directory_and_the_fix(chat_target, conversation, write_jsonl, tmp_path):
    with pytest.raises(DraftlineError, match=r"missing meta.json.*draftline prepare"):
        TokenDataset(tmp_path)
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(0)])
    prepare(_config(chat_target, [path], tmp_path / "ds"))
    with pytest.raises(DraftlineError, match="not empty.*--overwrite"):
        prepare(_config(chat_target, [path], tmp_path / "ds"))
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    meta["format_version"] = FORMAT_VERSION + 1
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DraftlineError, match=f"format version {FORMAT_VERSION + 1}.*prepare the data again"):
        TokenDataset(tmp_path / "ds")


def test_prepare_cli_end_to_end(chat_target, mixed_input, tmp_path, capsys):
    out = tmp_path / "ds"
    code = main(["prepare", "--target", str(chat_target), "--input", mixed_input, "--out", str(out), "--heldout", "2",
                 "--workers", "2", "--thinking", "off", "--max-length", "48"])
    printed = capsys.readouterr().out
    assert code == 0
    for expected in ("samples", "tokens", "mean", "p99", "trained", "no_assistant_turn", "unknown_role", "held out"):
        assert expected in printed
    ds = TokenDataset(out)
    assert ds.meta["tokenizer"]["thinking"] is False and ds.lengths.max() <= 48
    code = main(["prepare", "--target", str(chat_target), "--input", mixed_input, "--out", str(out), "--strict", "--overwrite"])
    assert code == 2 and "mixed.jsonl:41" in capsys.readouterr().err


def test_malformed_line_is_skipped_and_counted_and_strict_stops_there(chat_target, conversation, write_jsonl, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(0), conversation(1), '{"messages": [}', conversation(2)])
    meta = prepare(_config(chat_target, [path], tmp_path / "ds", workers=2))
    assert meta["num_samples"] == 3 and meta["skipped"] == {"malformed_json": 1}
    assert meta["skip_examples"]["malformed_json"][0].startswith(f"{path}:3: ")
    with pytest.raises(DraftlineError, match=r"a\.jsonl:3: malformed JSON .*--strict stops here"):
        prepare(_config(chat_target, [path], tmp_path / "strict", workers=2, strict=True))


def test_workers_end_although_the_parent_handles_sigterm(chat_target, mixed_input, tmp_path):
    """An in-process `train` installs SIGTERM handlers; forked workers must not inherit them, or
    pool.terminate() at the end of prepare cannot stop a worker and prepare hangs."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        meta = prepare(_config(chat_target, [mixed_input], tmp_path / "ds", workers=2))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert meta["num_samples"] == 41
