"""tools/data/math_eval.py: MATH-500 / AIME-style files -> verl rows the math_dapo verifier scores."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import load_rows
from megatron_dapo.reward.manager import route_data_source
from megatron_dapo.reward.math_dapo import compute_score

TOOL = Path(__file__).resolve().parents[2] / "tools" / "data" / "math_eval.py"
PREFIX = "Solve the following math problem step by step."


def load_tool():
    spec = importlib.util.spec_from_file_location("tools_data_math_eval", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def strip_source(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "_source"} for r in rows]


MATH500 = [
    # MATH-500 rows: answer given; solution too
    {
        "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
        "solution": "We get $\\boxed{\\frac{3}{4}}$.",
        "answer": "\\frac{3}{4}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    },
    # original MATH: only a solution; the last box (nested braces) is the answer
    {"problem": "Simplify $\\sqrt{16}$.", "solution": "First \\boxed{x}, then $\\boxed{\\sqrt{16}=4}$ so \\boxed{4}."},
    {"problem": "Nested?", "solution": "$\\boxed{\\frac{1}{\\sqrt{2}}}$"},
]


def test_math500_jsonl(tmp_path, capsys):
    tool = load_tool()
    src = tmp_path / "math500.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MATH500))
    out = tmp_path / "out" / "math500.parquet"
    assert tool.main(["--input", str(src), "--output", str(out)]) == 0
    assert "wrote 3 rows" in capsys.readouterr().out
    rows = strip_source(load_rows([str(out)]))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{3}{4}", "4", "\\frac{1}{\\sqrt{2}}"]
    first = rows[0]
    assert first["data_source"] == "math" and route_data_source("math") == "math_dapo"
    assert first["ability"] == "MATH" and first["reward_model"]["style"] == "rule-lighteval/MATH_v2"
    content = first["prompt"][0]["content"]
    assert first["prompt"][0]["role"] == "user" and content.startswith(PREFIX)
    assert MATH500[0]["problem"] in content and content.endswith('after "Answer:".')
    assert first["extra_info"] == {
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
        "split": "test",
        "index": 0,
    }
    # the built-in verifier accepts the ground truth in the format the prompt asks for, and rejects another
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(f"work...\nAnswer: {truth}", truth)["acc"] is True
        assert compute_score("work...\nAnswer: 17", truth)["acc"] is False


def test_aime_parquet_and_json_list(tmp_path):
    tool = load_tool()
    records = [
        {"ID": "2024-I-1", "Problem": "Find $x$ if $x+1=205$.", "Solution": "...", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find $y$.", "Solution": "...", "Answer": 25},
    ]
    src = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist(records), src)
    out = tmp_path / "aime.jsonl"
    assert tool.main(["--input", str(src), "--output", str(out), "--data-source", "aime2024", "--no-wrap"]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["204", "25"]
    assert rows[0]["prompt"] == [{"role": "user", "content": "Find $x$ if $x+1=205$."}]
    assert rows[1]["extra_info"] == {"ID": "2024-I-2", "split": "test", "index": 1}
    assert {r["data_source"] for r in rows} == {"aime2024"} and route_data_source("aime2024") == "math_dapo"

    as_json = tmp_path / "aime.json"
    as_json.write_text(json.dumps([{"question": "Q?", "answer": "7"}]))
    assert tool.main(["--input", str(as_json), "--output", str(tmp_path / "q.jsonl"), "--split", "val"]) == 0
    (row,) = strip_source(load_rows([str(tmp_path / "q.jsonl")]))
    assert row["reward_model"]["ground_truth"] == "7" and row["extra_info"] == {"split": "val", "index": 0}


def test_last_boxed():
    tool = load_tool()
    assert tool.last_boxed("a \\boxed{x{y}z} b \\boxed{2}") == "2"
    assert tool.last_boxed("\\boxed {3}") == "3"
    assert tool.last_boxed("\\boxed{open") is None
    assert tool.last_boxed("none") is None


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"answer": "1"}, "row 1: field 'problem': missing; expected 'problem' or 'question'"),
        ({"problem": "  ", "answer": "1"}, "row 1: field 'problem': expected a non-empty string"),
        ({"problem": "p"}, "row 1: field 'answer': missing; expected 'answer' or a 'solution'"),
        ({"problem": "p", "solution": "no box"}, "row 1: field 'solution': expected a non-empty \\boxed{...} answer"),
        ({"problem": "p", "answer": ["1"]}, "row 1: field 'answer': expected a string or number, got list"),
        ({"problem": "p", "solution": 3}, "row 1: field 'solution': expected a string, got int"),
    ],
)
def test_bad_rows_name_row_and_field(tmp_path, capsys, record, message):
    tool = load_tool()
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"problem": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}: ") and message in err
    assert not (tmp_path / "o.parquet").exists()


def test_bad_files(tmp_path, capsys):
    tool = load_tool()
    bad = tmp_path / "x.json"
    bad.write_text('{"problem": "p"}')
    assert tool.main(["--input", str(bad), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "expected a JSON list of objects, got dict" in capsys.readouterr().err
    bad.write_text('[{"problem": "p", "answer": 1}, 3]')
    assert tool.main(["--input", str(bad), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "row 1: expected an object with problem and answer fields, got 3" in capsys.readouterr().err
    assert tool.main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_warns_when_the_data_source_is_not_the_math_verifiers(tmp_path, capsys):
    tool = load_tool()
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--data-source", "gpqa"]) == 0
    assert "data_source 'gpqa' is not scored by the built-in math verifier" in capsys.readouterr().err
