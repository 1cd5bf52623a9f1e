"""The tools/data preprocessors, run through their CLI entry points on small inputs made here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import DataError, load_rows

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "data"


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tools_data_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def strip_source(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "_source"} for r in rows]


# ------------------------------------------------------------------------------------------------- gsm8k


def test_gsm8k(tmp_path, capsys) -> None:
    gsm8k = load_tool("gsm8k")
    src = tmp_path / "gsm8k.jsonl"
    records = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "Big?", "answer": "so\n#### 1,250"},
        {"question": "Below?", "answer": "#### -3"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out" / "test.parquet"
    assert gsm8k.main(["--input", str(src), "--output", str(out), "--split", "test"]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1250", "-3"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [
        {
            "role": "user",
            "content": "Tom has 3 apples and buys 4. How many? "
            'Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert first["extra_info"] == {
        "split": "test",
        "index": 0,
        "answer": records[0]["answer"],
        "question": records[0]["question"],
    }
    assert "wrote 3 rows" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"answer": "#### 1"}, "row 1: field 'question': missing"),
        ({"question": "q", "answer": 5}, "row 1: field 'answer': expected a string, got int"),
        ({"question": "q", "answer": "no marker"}, "row 1: field 'answer': expected a final line '#### <number>'"),
    ],
)
def test_gsm8k_bad_input(tmp_path, capsys, record: dict, message: str) -> None:
    gsm8k = load_tool("gsm8k")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"question": "ok", "answer": "#### 2"}) + "\n" + json.dumps(record) + "\n")
    assert gsm8k.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    assert f"error: {src}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


# ------------------------------------------------------------------------------------------------- dapo math


def test_dapo_math_verl_form_wraps_and_dedups(tmp_path) -> None:
    dapo = load_tool("dapo_math")
    wrapped = dapo.wrap_problem("What is 2+2?")
    records = [
        {  # as the DAPO-Math-17k release: already wrapped, uuid index
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": wrapped}],
            "ability": "MATH",
            "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "4"},
            "extra_info": {"index": "a1b2"},
        },
        {  # the same problem again (the release repeats problems)
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": wrapped}],
            "ability": "MATH",
            "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "4"},
            "extra_info": {"index": "c3d4"},
        },
        {  # not wrapped yet
            "data_source": "x",
            "prompt": [{"role": "user", "content": "Find x if x+1=3."}],
            "ability": "MATH",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": "e5f6"},
        },
    ]
    src = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(records), src)
    out = tmp_path / "train.parquet"
    assert dapo.main(["--input", str(src), "--output", str(out)]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert len(rows) == 2
    assert rows[0]["prompt"][0]["content"] == wrapped
    assert rows[0]["prompt"][0]["content"] == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 2+2?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert rows[1]["prompt"][0]["content"] == dapo.wrap_problem("Find x if x+1=3.")
    assert {r["data_source"] for r in rows} == {"math_dapo"}
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "2"]
    assert rows[1]["extra_info"] == {"source_index": "e5f6", "split": "train", "index": 1}
    assert dapo.main(["--input", str(src), "--output", str(out), "--no-dedup", "--no-wrap"]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert len(rows) == 3 and rows[2]["prompt"][0]["content"] == "Find x if x+1=3."


def test_dapo_math_question_answer_form(tmp_path) -> None:
    dapo = load_tool("dapo_math")
    src = tmp_path / "qa.jsonl"
    src.write_text(
        json.dumps({"question": "1+1?", "answer": 2})
        + "\n"
        + json.dumps({"problem": "2+3?", "answer": "5"})
        + "\n"
        + json.dumps({"question": "4+4?", "answer": "8"})
        + "\n"
    )
    out = tmp_path / "qa.jsonl.out.jsonl"
    assert dapo.main(["--input", str(src), "--output", str(out), "--split", "val", "--max-rows", "2"]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert [r["prompt"][0]["content"] for r in rows] == [dapo.wrap_problem("1+1?"), dapo.wrap_problem("2+3?")]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "5"]
    assert rows[0]["extra_info"] == {"split": "val", "index": 0}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "?"}, "row 0: field 'prompt': missing; expected either 'prompt' (verl format) or 'question'"),
        ({"question": "q"}, "row 0: field 'answer': missing"),
        ({"question": "q", "answer": ""}, "row 0: field 'answer': expected a non-empty answer"),
        ({"question": 3, "answer": "1"}, "row 0: field 'question': expected a non-empty string"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "row 0: field 'prompt[0].content': missing"),
        ({"prompt": "p", "reward_model": {}}, "row 0: field 'reward_model.ground_truth': missing"),
        ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, "expected a message with role 'user'"),
        ({"question": "q", "answer": "1", "extra_info": [1]}, "row 0: field 'extra_info': expected a mapping"),
    ],
)
def test_dapo_math_bad_input(tmp_path, record: dict, message: str) -> None:
    dapo = load_tool("dapo_math")
    with pytest.raises(DataError) as info:
        dapo.convert([record], "train", "in.jsonl")
    assert str(info.value).startswith("in.jsonl: row 0: ")
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------------- instruction json


def test_instruction_json(tmp_path) -> None:
    tool = load_tool("instruction_json")
    src = tmp_path / "fin.json"
    records = [
        {"instruction": "Pick one.", "input": "A) up B) down", "output": "Reasoning... \\boxed{B}"},
        {"instruction": "Compute.", "input": "", "output": "first \\boxed{1} then \\boxed{\\frac{1}{2}}"},
        {"instruction": "No input field.", "output": "\\boxed{ C }"},
    ]
    src.write_text(json.dumps(records))
    out = tmp_path / "fin.parquet"
    assert tool.main(["--input", str(src), "--output", str(out), "--data-source", "fin_x", "--split", "test"]) == 0
    rows = strip_source(load_rows([str(out)]))
    assert [r["prompt"][0]["content"] for r in rows] == ["Pick one.\n\nA) up B) down", "Compute.", "No input field."]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["B", "\\frac{1}{2}", "C"]
    assert {r["data_source"] for r in rows} == {"fin_x"}
    assert rows[2]["extra_info"] == {"split": "test", "index": 2}
    assert tool.main(["--input", str(src), "--output", str(out)]) == 0
    assert load_rows([str(out)])[0]["data_source"] == "financial_choice"


def test_last_boxed() -> None:
    tool = load_tool("instruction_json")
    assert tool.last_boxed("a \\boxed{x{y}z} b") == "x{y}z"
    assert tool.last_boxed("\\boxed{open") is None
    assert tool.last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"instruction": "i"}, "row 1: field 'output': missing"),
        ({"instruction": "i", "output": "no box"}, "row 1: field 'output': expected a non-empty \\boxed{...} answer"),
        ({"instruction": 1, "output": "\\boxed{A}"}, "row 1: field 'instruction': expected a string, got int"),
        ({"instruction": "i", "input": ["x"], "output": "\\boxed{A}"}, "row 1: field 'input': expected a string"),
        ("text", "row 1: expected an object with instruction, input, output; got str"),
    ],
)
def test_instruction_json_bad_input(tmp_path, capsys, payload, message: str) -> None:
    tool = load_tool("instruction_json")
    src = tmp_path / "bad.json"
    src.write_text(json.dumps([{"instruction": "ok", "input": "", "output": "\\boxed{A}"}, payload]))
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    assert f"error: {src}: {message}" in capsys.readouterr().err


def test_instruction_json_not_a_list(tmp_path, capsys) -> None:
    tool = load_tool("instruction_json")
    src = tmp_path / "obj.json"
    src.write_text(json.dumps({"instruction": "i"}))
    assert tool.main(["--input", str(src), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "expected a JSON list of {instruction, input, output} objects, got dict" in capsys.readouterr().err
    assert tool.main(["--input", str(tmp_path / "none.json"), "--output", str(tmp_path / "o.parquet")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- arithmetic


def test_make_arithmetic(tmp_path) -> None:
    tool = load_tool("make_arithmetic")
    argv = ["--output-dir", str(tmp_path), "--train-size", "20", "--val-size", "5", "--seed", "3", "--ops", "+-"]
    assert tool.main(argv) == 0
    train = strip_source(load_rows([str(tmp_path / "train.parquet")]))
    val = strip_source(load_rows([str(tmp_path / "val.parquet")]))
    assert len(train) == 20 and len(val) == 5
    assert {r["extra_info"]["split"] for r in train} == {"train"} and {r["extra_info"]["split"] for r in val} == {"val"}
    assert {r["prompt"][0]["content"][1] for r in train} <= {"+", "-"}
    assert tool.main(argv + ["--format", "jsonl"]) == 0
    assert strip_source(load_rows([str(tmp_path / "train.jsonl")])) == train
    with pytest.raises(SystemExit):
        tool.main(["--output-dir", str(tmp_path), "--ops", "/"])
