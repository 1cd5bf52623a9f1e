"""RLDataset: chat template, truncation modes, overlong filtering and item fields."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from megatron_dapo.config import DataConfig
from megatron_dapo.data import DataError, RLDataset, build_dataset, load_rows, truncate_prompt


def char_id(ch: str) -> int:
    return 9 + ord(ch) - 0x20  # the tiny tokenizer's id of a printable ASCII character


def row(prompt, truth="1", source="arithmetic", **extra) -> dict:
    return {"data_source": source, "prompt": prompt, "reward_model": {"ground_truth": truth}, **extra}


def config(**kw) -> DataConfig:
    return dataclasses.replace(DataConfig(), **kw)


def test_chat_template_item_fields(tiny_tokenizer) -> None:
    rows = [
        row([{"role": "user", "content": "3+4="}], "7", extra_info={"index": 5, "split": "train"}),
        row([{"role": "user", "content": "1+1="}], ["2", "two"], source="other"),
    ]
    ds = RLDataset(rows, tiny_tokenizer, config(max_prompt_length=64))
    assert len(ds) == 2
    item = ds[0]
    assert item["raw_prompt"] == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    nl = 8
    assert item["input_ids"] == [1, 4, nl, char_id("3"), char_id("+"), char_id("4"), char_id("="), 2, nl, 1, 5, nl]
    assert item["data_source"] == "arithmetic" and item["ground_truth"] == "7"
    assert item["extra_info"] == {"index": 5, "split": "train"}
    assert item["index"] == 0
    assert ds[1]["extra_info"] == {} and ds[1]["ground_truth"] == ["2", "two"] and ds[1]["index"] == 1
    # items are copies: editing one does not change the dataset
    item["input_ids"].append(99)
    item["extra_info"]["x"] = 1
    assert len(ds[0]["input_ids"]) == 12 and "x" not in ds[0]["extra_info"]


def test_plain_string_and_no_chat_template(tiny_tokenizer) -> None:
    ds = RLDataset([row("ab c")], tiny_tokenizer, config())
    assert ds[0]["raw_prompt"] == "ab c"
    assert ds[0]["input_ids"] == [char_id("a"), char_id("b"), char_id(" "), char_id("c")]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    ds = RLDataset([row(messages)], tiny_tokenizer, config(apply_chat_template=False))
    assert ds[0]["raw_prompt"] == "S\nq"
    assert ds[0]["input_ids"] == [char_id("S"), 8, char_id("q")]


def test_prompt_key(tiny_tokenizer) -> None:
    rows = [{"data_source": "d", "question": "xy", "reward_model": {"ground_truth": "1"}}]
    assert RLDataset(rows, tiny_tokenizer, config(prompt_key="question"))[0]["raw_prompt"] == "xy"
    with pytest.raises(DataError, match=r"rows: row 0: field 'prompt': missing"):
        RLDataset(rows, tiny_tokenizer, config(), name="rows")


def test_truncate_prompt_modes_by_hand() -> None:
    ids = [10, 11, 12, 13, 14, 15, 16]
    assert truncate_prompt(ids, 4, "left") == [13, 14, 15, 16]
    assert truncate_prompt(ids, 4, "right") == [10, 11, 12, 13]
    assert truncate_prompt(ids, 4, "middle") == [10, 11, 15, 16]
    assert truncate_prompt(ids, 5, "middle") == [10, 11, 14, 15, 16]  # head = 5 // 2, tail = the rest
    assert truncate_prompt(ids, 1, "middle") == [16]
    assert truncate_prompt(ids, 7, "error") == ids  # at the limit: unchanged
    with pytest.raises(DataError, match="prompt is 7 tokens, longer than data.max_prompt_length=6"):
        truncate_prompt(ids, 6, "error")
    with pytest.raises(DataError, match="data.truncation: expected one of"):
        truncate_prompt(ids, 6, "top")


@pytest.mark.parametrize(
    ("mode", "kept"),
    [("left", "cdefgh"), ("right", "abcdef"), ("middle", "abcfgh")],
)
def test_dataset_truncation(tiny_tokenizer, mode: str, kept: str) -> None:
    ds = RLDataset([row("abcdefgh"), row("xy")], tiny_tokenizer, config(max_prompt_length=6, truncation=mode))
    assert ds[0]["input_ids"] == [char_id(c) for c in kept]
    assert ds[0]["raw_prompt"] == "abcdefgh"  # the text before truncation
    assert ds[1]["input_ids"] == [char_id("x"), char_id("y")]


def test_truncation_error_names_file_row_length_and_limit(tiny_tokenizer, tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row("abc")) + "\n" + json.dumps(row("abcdefgh")) + "\n")
    with pytest.raises(DataError) as info:
        build_dataset([str(path)], tiny_tokenizer, config(max_prompt_length=6, truncation="error"))
    message = str(info.value)
    assert message.startswith(f"{path}: row 1: prompt is 8 tokens, longer than data.max_prompt_length=6")
    assert "filter_overlong_prompts" in message


def test_filter_overlong_prompts(tiny_tokenizer, caplog) -> None:
    rows = [row("abc", "0"), row("abcdefgh", "1"), row("ab", "2"), row("abcdefg", "3")]
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.data.dataset"):
        ds = RLDataset(rows, tiny_tokenizer, config(max_prompt_length=6, filter_overlong_prompts=True), name="train")
    assert len(ds) == 2 and ds.num_filtered == 2
    assert [ds[i]["ground_truth"] for i in range(2)] == ["0", "2"]
    assert [ds[i]["index"] for i in range(2)] == [0, 1]  # positions in the filtered dataset
    assert "train: dropped 2 of 4 prompts longer than data.max_prompt_length=6" in caplog.text
    with pytest.raises(DataError, match="all 2 prompts are longer"):
        RLDataset(rows[1::2], tiny_tokenizer, config(max_prompt_length=6, filter_overlong_prompts=True))


def test_dataset_errors(tiny_tokenizer) -> None:
    with pytest.raises(DataError, match="no rows"):
        RLDataset([], tiny_tokenizer, config())
    with pytest.raises(DataError, match="max_prompt_length: expected a positive integer"):
        RLDataset([row("a")], tiny_tokenizer, config(max_prompt_length=0))
    with pytest.raises(DataError, match=r"mine: row 1: field 'data_source': expected a string"):
        RLDataset([row("a"), row("b", source=3)], tiny_tokenizer, config(), name="mine")


def test_tokenizer_without_chat_template(tiny_tokenizer, tmp_path) -> None:
    tiny_tokenizer.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tmp_path))
    plain.chat_template = None
    with pytest.raises(DataError, match=r"row 0: the tokenizer has no chat_template; set data.apply_chat_template"):
        RLDataset([row([{"role": "user", "content": "a"}])], plain, config())


def test_loaded_rows_keep_their_origin_in_errors(tiny_tokenizer, tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(row("abcdefgh")) + "\n")
    rows = load_rows([str(path)])
    with pytest.raises(DataError, match=rf"^{path}: row 0: prompt is 8 tokens"):
        RLDataset(rows, tiny_tokenizer, config(max_prompt_length=4))
