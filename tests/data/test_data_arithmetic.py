"""The synthetic arithmetic task: rows, files and the rule scorer."""

from __future__ import annotations

import pytest
import torch

import megatron_dapo.tasks.arithmetic as arithmetic
from megatron_dapo.config import CustomFunctionConfig, RewardConfig
from megatron_dapo.data import load_rows
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.tasks.arithmetic import (
    compute_score,
    compute_score_exact,
    make_rows,
    make_table_rows,
    write_dataset,
)


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


# ------------------------------------------------------------------------------------------------- the whole table


def test_table_rows_list_every_prompt_once() -> None:
    rows = make_table_rows(max_operand=4)
    prompts = [r["prompt"][0]["content"] for r in rows]
    assert prompts == [f"{a}+{b}=" for a in range(5) for b in range(5)]  # 25 prompts, order (a, b)
    assert [r["reward_model"]["ground_truth"] for r in rows] == [str(a + b) for a in range(5) for b in range(5)]
    assert [r["extra_info"] for r in rows] == [{"index": i, "split": "val"} for i in range(25)]
    assert all(r["data_source"] == "arithmetic" and r["ability"] == "arithmetic" for r in rows)

    # the same row format as make_rows: every random row is one of the table's rows (up to its index/split)
    def without_index(row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "extra_info"}

    table = {r["prompt"][0]["content"]: r for r in rows}
    for row in make_rows(200, seed=5, max_operand=4):
        assert without_index(row) == without_index(table[row["prompt"][0]["content"]])


def test_table_rows_match_what_make_rows_can_draw() -> None:
    ops = ("+", "-", "*")
    rows = make_table_rows(max_operand=2, ops=ops, split="test")
    # + and * list all 9 ordered pairs; - only a >= b (6 pairs), as make_rows swaps the operands
    assert len(rows) == 9 + 6 + 9
    assert len({r["prompt"][0]["content"] for r in rows}) == len(rows)
    drawn = {(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in make_rows(3000, 7, 2, ops)}
    assert {(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows} == drawn
    assert {r["extra_info"]["split"] for r in rows} == {"test"}
    assert make_table_rows(max_operand=1, ops=("*", "*")) == make_table_rows(max_operand=1, ops=("*",))


def test_table_rows_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_operand must be >= 0, got -1"):
        make_table_rows(max_operand=-1)
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        make_table_rows(ops=())
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        make_table_rows(ops=("+", "/"))


# ------------------------------------------------------------------------------------------------- exact match


@pytest.mark.parametrize(
    ("completion", "truth", "score"),
    [
        ("7", "7", 1.0),
        (" 7\n", "7", 1.0),  # surrounding whitespace is not part of the answer
        ("12", "12", 1.0),
        ("-3", "-3", 1.0),
        ("9", 9, 1.0),  # an integer ground truth compares as its string
        ("7", " 7 ", 1.0),
        ("7junk", "7", 0.0),  # what the lenient scorer rewards and this one must not
        ("7 is it", "7", 0.0),
        ("7 7", "7", 0.0),
        ("17", "7", 0.0),
        ("07", "7", 0.0),
        ("seven", "7", 0.0),
        ("", "0", 0.0),
        ("   ", "", 0.0),  # an empty answer is never correct
    ],
)
def test_compute_score_exact(completion: str, truth, score: float) -> None:
    result = compute_score_exact("arithmetic", completion, truth, {"index": 0})
    assert result == {"score": score, "acc": score == 1.0, "pred": completion.strip()}


def test_exact_score_through_the_reward_manager(tiny_tokenizer) -> None:
    """The manager strips EOS before scoring: "7<|im_end|>" is right, "7x<|im_end|>" and a truncated "7xy" are not."""
    eos = tiny_tokenizer.eos_token_id
    config = RewardConfig(
        custom_function=CustomFunctionConfig(path=arithmetic.__file__, name="compute_score_exact"), num_workers=0
    )
    manager = RewardManager(tiny_tokenizer, config, max_response_length=3, eos_token_id=eos)
    texts = [("7", True), ("7x", True), ("7xy", False), ("8", True)]
    ids = torch.zeros(len(texts), 3, dtype=torch.long)
    mask = torch.zeros(len(texts), 3, dtype=torch.long)
    for i, (text, stop) in enumerate(texts):
        row = tiny_tokenizer.encode(text, add_special_tokens=False) + ([eos] if stop else [])
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    result = manager(ids, mask, ["arithmetic"] * 4, ["7", "7", "7", "7"], [{}] * 4)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert result.extra["pred"] == ["7", "7x", "7xy", "8"]
    assert result.overlong.tolist() == [False, False, True, False]
