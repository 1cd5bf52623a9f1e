"""The synthetic arithmetic task: rows, files and the rule scorer."""

from __future__ import annotations

import pytest

from megatron_dapo.data import load_rows
from megatron_dapo.tasks.arithmetic import compute_score, make_rows, write_dataset


def test_rows_are_verl_format_and_correct() -> None:
    rows = make_rows(50, seed=3, ops=("+", "-", "*"), split="val")
    assert rows == make_rows(50, seed=3, ops=("+", "-", "*"), split="val")
    assert rows != make_rows(50, seed=4, ops=("+", "-", "*"), split="val")
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "arithmetic"
        assert row["extra_info"] == {"index": i, "split": "val"}
        content = row["prompt"][0]["content"]
        assert row["prompt"][0]["role"] == "user" and content.endswith("=")
        a, op, b = content[0], content[1], content[2]  # single-digit operands: "a<op>b="
        assert len(content) == 4
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(expected)}
        assert expected >= 0


def test_default_answer_space_is_small() -> None:
    answers = {int(row["reward_model"]["ground_truth"]) for row in make_rows(500, seed=0)}
    assert answers <= set(range(19))
    assert len(answers) > 10


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ops"):
        make_rows(3, seed=0, ops=("/",))
    with pytest.raises(ValueError, match="n must be"):
        make_rows(-1, seed=0)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_and_load(tmp_path, suffix: str) -> None:
    rows = make_rows(7, seed=1)
    path = write_dataset(tmp_path / f"train{suffix}", rows)
    loaded = load_rows([str(path)])
    assert [{k: v for k, v in r.items() if k != "_source"} for r in loaded] == rows
    assert loaded[6]["_source"] == f"{path}: row 6"


@pytest.mark.parametrize(
    ("completion", "truth", "score", "pred"),
    [
        ("7", "7", 1.0, "7"),
        ("  7<|im_end|>", "7", 1.0, "7"),
        ("\n7 is it", "7", 1.0, "7"),
        ("the answer: 12", "12", 1.0, "12"),
        ("17", "7", 0.0, "17"),
        ("07", "7", 0.0, "07"),
        ("8 7", "7", 0.0, "8"),
        ("seven", "7", 0.0, ""),
        ("", "0", 0.0, ""),
        ("-3", "-3", 1.0, "-3"),
        ("9", 9, 1.0, "9"),  # an integer ground truth (e.g. from a hand-written file) compares as its string
    ],
)
def test_compute_score(completion: str, truth, score: float, pred: str) -> None:
    result = compute_score("arithmetic", completion, truth, {"index": 0})
    assert result == {"score": score, "acc": score == 1.0, "pred": pred}
