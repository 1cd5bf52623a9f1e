"""Loading and validating verl-format rows from parquet and jsonl."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import DataError, load_rows, read_records, validate_row, write_rows

GOOD = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"split": "train", "index": 0},
}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_parquet_written_by_pyarrow_loads(tmp_path) -> None:
    # A file as verl's preprocessors (HF datasets -> parquet) lay it out: nested list<struct> prompts.
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "data_source": "other"}]), path)
    rows = load_rows([str(path)])
    assert len(rows) == 2
    assert rows[0]["prompt"] == GOOD["prompt"]
    assert rows[1]["data_source"] == "other"
    assert rows[0]["_source"] == f"{path}: row 0"


def test_jsonl_and_files_in_order(tmp_path) -> None:
    plain = {**GOOD, "prompt": "2+2=", "reward_model": {"ground_truth": 4}}
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    (tmp_path / "b.jsonl").write_text(json.dumps(plain) + "\n\n")  # blank lines are skipped
    rows = load_rows([str(a), str(tmp_path / "b.jsonl")])
    assert [r["prompt"] for r in rows] == [GOOD["prompt"], "2+2="]
    assert rows[1]["reward_model"]["ground_truth"] == 4
    assert rows[1]["_source"] == f"{tmp_path / 'b.jsonl'}: row 0"
    assert load_rows(str(a))[0]["data_source"] == "openai/gsm8k"  # a single path is accepted too


def test_write_rows_round_trip_and_drops_source(tmp_path) -> None:
    rows = load_rows([str(write_jsonl(tmp_path / "in.jsonl", [GOOD, GOOD]))])
    out = write_rows(tmp_path / "out.parquet", rows)
    assert "_source" not in pq.read_table(out).column_names
    assert [{k: v for k, v in r.items() if k != "_source"} for r in load_rows([str(out)])] == [GOOD, GOOD]


def test_write_rows_mixed_column_types_is_clear(tmp_path) -> None:
    other = copy.deepcopy(GOOD)
    other["reward_model"]["ground_truth"] = ["a", "b"]
    with pytest.raises(DataError, match="mixed types"):
        write_rows(tmp_path / "x.parquet", [GOOD, other])


def mutate(path: str, value) -> dict:
    row = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = row
    for key in parents:
        node = node[key] if not key.isdigit() else node[int(key)]
    if value is DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return row


DELETE = object()

BAD_ROWS = [
    ("prompt", DELETE, "'prompt': missing"),
    ("prompt", 5, "'prompt': expected a list of {role, content} messages or a string, got int"),
    ("prompt", [], "'prompt': expected at least one message"),
    ("prompt", "", "'prompt': expected a non-empty string"),
    ("prompt.1", "hi", "'prompt[1]': expected a {role, content} mapping, got str"),
    ("prompt.1.content", DELETE, "'prompt[1].content': missing"),
    ("prompt.0.role", DELETE, "'prompt[0].role': missing"),
    ("prompt.1.content", 7, "'prompt[1].content': expected a string, got int"),
    ("data_source", DELETE, "'data_source': missing"),
    ("data_source", 1, "'data_source': expected a string, got int"),
    ("reward_model", DELETE, "'reward_model': missing"),
    ("reward_model", "7", "'reward_model': expected a mapping, got str"),
    ("reward_model.ground_truth", DELETE, "'reward_model.ground_truth': missing"),
    ("reward_model.ground_truth", None, "'reward_model.ground_truth': missing"),
    ("reward_model.ground_truth", {"a": 1}, "'reward_model.ground_truth': expected a string, number or list, got dict"),
    ("reward_model.ground_truth", True, "'reward_model.ground_truth': expected a string, number or list, got bool"),
    ("extra_info", [1], "'extra_info': expected a mapping, got list"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_ROWS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_ROWS])
def test_bad_row_names_file_row_and_field(tmp_path, field: str, value, message: str) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, mutate(field, value)])
    with pytest.raises(DataError) as info:
        load_rows([str(path)])
    assert str(info.value).startswith(f"{path}: row 2: field ")
    assert message in str(info.value)


def test_valid_variants_pass() -> None:
    for truth in ("7", 7, 7.5, ["a", "b"]):
        validate_row(mutate("reward_model.ground_truth", truth), "here")
    validate_row(mutate("extra_info", None), "here")
    validate_row(mutate("extra_info", DELETE), "here")
    validate_row({**GOOD, "question": GOOD["prompt"], "prompt": 1}, "here", prompt_key="question")


def test_bad_row_in_parquet_names_file_and_row(tmp_path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "data_source": None}]), path)
    with pytest.raises(DataError, match=rf"^{path}: row 1: field 'data_source': expected a string, got NoneType"):
        load_rows([str(path)])


def test_file_level_errors(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_rows([str(tmp_path / "missing.parquet")])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data.csv: unsupported file type '.csv'; expected one of"):
        load_rows([str(tmp_path / "data.csv")])
    with pytest.raises(DataError, match="no data files given"):
        load_rows([])
    (tmp_path / "broken.jsonl").write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: row 1 \(line 2\): invalid JSON"):
        read_records(tmp_path / "broken.jsonl")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"list.jsonl: row 0 \(line 1\): expected a JSON object, got list"):
        read_records(tmp_path / "list.jsonl")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="fake.parquet: cannot read as parquet"):
        read_records(tmp_path / "fake.parquet")
