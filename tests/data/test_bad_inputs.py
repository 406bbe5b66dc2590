"""Bad inputs to ``prepare``: every case a message naming the file (and line) and the fix, no traceback.

A bad record is skipped and counted by reason (with the first examples' file:line), or with --strict
stops the run there; a whole file that cannot be read (empty, binary, not the format its name says,
truncated where nothing can be recovered) is an error naming the file.
"""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftline.cli import main
from draftline.data.prepare import PrepareConfig, prepare
from draftline.errors import DraftlineError


def _config(target, inputs, out, **kwargs):
    return PrepareConfig(target=target, inputs=[str(i) for i in inputs], out=out, progress=False, **kwargs)


def _lines(conversation, bad: bytes) -> bytes:
    good = [json.dumps(conversation(i)).encode() for i in range(3)]
    return b"\n".join([good[0], good[1], bad, good[2]]) + b"\n"


# A bad record: (line 3 of a JSONL file, reason it is counted under)
BAD_RECORDS = {
    "invalid_utf8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}', "bad_bytes"),
    "malformed_json": (b'{"messages": [{"role": "user", "content": "hi"},', "malformed_json"),
    "not_an_object": (b'[1, 2, 3]', "wrong_type"),
    "content_number": (b'{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}', "wrong_type"),
    "messages_string": (b'{"messages": "hello"}', "wrong_type"),
    "role_number": (b'{"messages": [{"role": 1, "content": "a"}, {"role": "assistant", "content": "x"}]}', "wrong_type"),
    "input_ids_strings": (b'{"input_ids": ["a", "b"], "loss_mask": [0, 1]}', "wrong_type"),
    "empty_messages": (b'{"messages": []}', "no_assistant_turn"),
    "missing_content": (b'{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "empty_content"),
    "missing_role": (b'{"messages": [{"content": "a"}, {"role": "assistant", "content": "x"}]}', "unknown_role"),
    "empty_record": (b'{}', "unrecognised_record"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_record_is_counted_or_stops_with_strict(chat_target, conversation, tmp_path, case):
    bad, reason = BAD_RECORDS[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(_lines(conversation, bad))
    meta = prepare(_config(chat_target, [path], tmp_path / "ds"))
    assert meta["num_samples"] == 3 and meta["skipped"] == {reason: 1}
    assert meta["skip_examples"][reason][0].startswith(f"{path}:3")
    with pytest.raises(DraftlineError, match=rf"data\.jsonl:3: .*\({reason}.*--strict stops here"):
        prepare(_config(chat_target, [path], tmp_path / "strict", strict=True))


def test_jsonl_cut_mid_line_is_counted_as_truncated(chat_target, conversation, tmp_path):
    text = "".join(json.dumps(conversation(i)) + "\n" for i in range(4))
    path = tmp_path / "cut.jsonl"
    path.write_text(text[: len(text) - 25])  # the last record loses its end and its newline
    meta = prepare(_config(chat_target, [path], tmp_path / "ds"))
    assert meta["num_samples"] == 3 and meta["skipped"] == {"malformed_json": 1}
    assert "looks truncated" in meta["skip_examples"]["malformed_json"][0]
    with pytest.raises(DraftlineError, match=r"cut\.jsonl:4: malformed JSON.*truncated"):
        prepare(_config(chat_target, [path], tmp_path / "strict", strict=True))


def _parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _bad_files(tmp_path, conversation):
    """name -> (path, a regex the error must match)."""
    records = [conversation(i) for i in range(4)]
    jsonl_text = "".join(json.dumps(r) + "\n" for r in records)
    files = {}
    (tmp_path / "empty.jsonl").write_bytes(b"")
    files["empty"] = (tmp_path / "empty.jsonl", r"empty\.jsonl: empty file")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    files["blank"] = (tmp_path / "blank.jsonl", r"blank\.jsonl: holds only whitespace")
    (tmp_path / "empty.json").write_text("[]")
    files["empty_json_list"] = (tmp_path / "empty.json", r"empty\.json: an empty JSON list")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 8)
    files["binary"] = (tmp_path / "binary.jsonl", r"binary\.jsonl: not a text JSONL file: it is binary")
    _parquet(tmp_path / "really_parquet.jsonl", records)
    files["parquet_named_jsonl"] = (tmp_path / "really_parquet.jsonl", r"really_parquet\.jsonl: .*a Parquet file; rename it to \.parquet")
    (tmp_path / "really_jsonl.parquet").write_text(jsonl_text)
    files["jsonl_named_parquet"] = (tmp_path / "really_jsonl.parquet", r"really_jsonl\.parquet: not a readable Parquet file; it is not Parquet")
    whole = _parquet(tmp_path / "whole.parquet", records).read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    files["truncated_parquet"] = (tmp_path / "cut.parquet", r"cut\.parquet: not a readable Parquet file; it is truncated or corrupt")
    _parquet(tmp_path / "zero.parquet", records[:0] or [{"messages": []}]).write_bytes(b"")
    files["zero_byte_parquet"] = (tmp_path / "zero.parquet", r"zero\.parquet: empty file")
    pq.write_table(pa.Table.from_pylist(records).slice(0, 0), tmp_path / "no_rows.parquet")
    files["zero_row_parquet"] = (tmp_path / "no_rows.parquet", r"no_rows\.parquet: a Parquet file with 0 rows")
    (tmp_path / "array.jsonl").write_text(json.dumps(records, indent=2))
    files["json_array_named_jsonl"] = (tmp_path / "array.jsonl", r"array\.jsonl: starts with '\[', a JSON array.*name it \.json")
    (tmp_path / "cut.json").write_text(json.dumps(records)[:-40])
    files["truncated_json"] = (tmp_path / "cut.json", r"cut\.json:1: malformed JSON .*looks truncated")
    (tmp_path / "latin1.json").write_bytes(json.dumps(records).replace("Question", "Qu\u00e9stion").encode("latin-1"))
    files["json_not_utf8"] = (tmp_path / "latin1.json", r"latin1\.json: not UTF-8 text .*re-save it as UTF-8")
    (tmp_path / "text.jsonl").write_text("hello, this is a plain text file\n")
    files["plain_text"] = (tmp_path / "text.jsonl", r"text\.jsonl: does not start with a JSON object")
    (tmp_path / "utf16.jsonl").write_bytes(jsonl_text.encode("utf-16"))
    files["utf16"] = (tmp_path / "utf16.jsonl", r"utf16\.jsonl: not a text JSONL file: it is UTF-16 text; re-save it as UTF-8")
    gz = gzip.compress(jsonl_text.encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    files["truncated_gzip"] = (tmp_path / "cut.jsonl.gz", r"cut\.jsonl\.gz: the gzip stream is cut or corrupt")
    (tmp_path / "gz.jsonl").write_bytes(gz)
    files["gzip_named_jsonl"] = (tmp_path / "gz.jsonl", r"gz\.jsonl: .*gzip-compressed; name it \.jsonl\.gz")
    return files


FILE_CASES = ["empty", "blank", "empty_json_list", "binary", "parquet_named_jsonl", "jsonl_named_parquet", "truncated_parquet",
              "zero_byte_parquet", "json_array_named_jsonl", "truncated_json", "json_not_utf8", "plain_text",
              "truncated_gzip", "gzip_named_jsonl", "utf16", "zero_row_parquet"]


def test_unreadable_files_are_errors_naming_the_file_and_the_fix(chat_target, conversation, tmp_path, capsys):
    files = _bad_files(tmp_path, conversation)
    assert sorted(files) == sorted(FILE_CASES)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(conversation(0)) + "\n")
    for name, (path, pattern) in files.items():
        with pytest.raises(DraftlineError, match=pattern):
            prepare(_config(chat_target, [good, path], tmp_path / f"ds-{name}"))
        assert not (tmp_path / f"ds-{name}").exists(), name  # nothing half-written
        # the command line: exit 2, the message, no traceback
        code = main(["prepare", "--target", str(chat_target), "--input", str(path), "--out", str(tmp_path / f"cli-{name}"),
                     "--workers", "1"])
        err = capsys.readouterr().err
        assert code == 2 and str(path) in err and "Traceback" not in err, (name, err)


def test_a_corpus_of_only_bad_records_is_an_error_not_an_empty_dataset(chat_target, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"messages": [\n')
    with pytest.raises(DraftlineError, match=r"no usable record .*all 2 were skipped .*malformed_json .*bad\.jsonl:2"):
        prepare(_config(chat_target, [path], tmp_path / "ds"))
    assert not (tmp_path / "ds").exists()


def test_the_summary_names_the_first_skipped_records(chat_target, conversation, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_bytes(_lines(conversation, BAD_RECORDS["invalid_utf8"][0]))
    assert main(["prepare", "--target", str(chat_target), "--input", str(path), "--out", str(tmp_path / "ds"), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "bad_bytes" in printed and f"e.g. {path}:3: invalid UTF-8 at byte" in printed


def test_a_utf8_byte_order_mark_is_fine(chat_target, conversation, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(conversation(i)) + "\n" for i in range(3)).encode())
    meta = prepare(_config(chat_target, [path], tmp_path / "ds"))
    assert meta["num_samples"] == 3 and meta["skipped"] == {}
