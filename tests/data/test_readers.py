import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftline.data import readers
from draftline.data.readers import PreTokenized, SkipRecord
from draftline.errors import DraftlineError


def _records(source):
    return [readers.normalize(readers.decode(r)) for r in readers.read_source(source)]


def test_jsonl_json_parquet_and_gzip_read_the_same(tmp_path, conversation, write_jsonl):
    records = [conversation(i) for i in range(5)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "a.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(open(jsonl).read())
    expected = [r["messages"] for r in records]
    for name in ("a.jsonl", "a.json", "a.parquet", "a.jsonl.gz"):
        assert _records(tmp_path / name) == expected, name
    assert [r.index for r in readers.read_source(jsonl)] == list(range(5))


def test_sharegpt_and_pretokenized(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                           {"from": "human", "value": "trailing question"}]},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    ])
    sharegpt, tokenized = _records(path)
    # empty system prompt dropped, turns after the last assistant turn cut
    assert sharegpt == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert isinstance(tokenized, PreTokenized) and tokenized.loss_mask.tolist() == [False, True, True]


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "user", "content": "hi"}]}, readers.NO_ASSISTANT_TURN),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]}, readers.EMPTY_CONTENT),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "x"}]}, readers.UNKNOWN_ROLE),
    ({"text": "plain"}, readers.UNRECOGNISED_RECORD),
    ({"input_ids": [1, 2], "loss_mask": [1]}, readers.UNRECOGNISED_RECORD),
])
def test_skip_reasons(record, reason):
    with pytest.raises(SkipRecord) as info:
        readers.normalize(record)
    assert info.value.reason == reason


def test_malformed_line_names_file_and_line(tmp_path, conversation, write_jsonl):
    path = write_jsonl(tmp_path / "bad.jsonl", [conversation(0), "", '{"messages": [oops'])
    records = list(readers.read_source(path))
    readers.decode(records[0])
    assert records[1].where == f"{path}:3"
    with pytest.raises(SkipRecord) as info:
        readers.decode(records[1])
    assert info.value.reason == readers.MALFORMED_JSON and "column" in info.value.detail


def test_missing_file_and_hub_name_without_datasets(tmp_path):
    with pytest.raises(DraftlineError, match="no such file"):
        readers.source_kind(tmp_path / "nope.jsonl")
    try:  # the hub path needs `datasets`; without it the error says how to get it
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DraftlineError, match="pip install datasets"):
            list(readers.read_source("someone/some_dataset:train"))
