"""The tiny local tokenizer: files, fixed ids, exact round trip, chat template."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_dapo.tasks.arithmetic import make_rows
from megatron_dapo.testing.tokenizer import (
    BASE_VOCAB_SIZE,
    EOS_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    UNK_TOKEN_ID,
    build_tiny_tokenizer,
)

ASCII_TEXT = st.text(alphabet=st.sampled_from(["\t", "\n"] + [chr(c) for c in range(0x20, 0x7F)]), max_size=80)


def char_id(ch: str) -> int:
    # Printable ASCII starts at id 9 (after 4 specials, 3 role words, tab and newline).
    return 9 + ord(ch) - 0x20


def test_directory_is_a_normal_hf_tokenizer(tmp_path) -> None:
    tok = build_tiny_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "tok" / name).is_file(), name
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == tok.chat_template
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert reloaded.get_vocab() == tok.get_vocab()
    assert len(tok) == BASE_VOCAB_SIZE == 104


def test_special_token_ids(tiny_tokenizer) -> None:
    assert tiny_tokenizer.pad_token_id == PAD_TOKEN_ID == 0
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_TOKEN_ID == 1
    assert tiny_tokenizer.eos_token_id == EOS_TOKEN_ID == 2
    assert tiny_tokenizer.unk_token_id == UNK_TOKEN_ID == 3
    assert tiny_tokenizer.bos_token_id is None
    # encode adds nothing (no bos/eos), unknown characters map to <unk>
    assert tiny_tokenizer.encode("7") == [char_id("7")]
    assert tiny_tokenizer.encode("\u00e9") == [UNK_TOKEN_ID]


def test_chat_template_output(tiny_tokenizer) -> None:
    messages = [{"role": "user", "content": "3+4="}]
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    nl = 8
    assert ids == [1, 4, nl, char_id("3"), char_id("+"), char_id("4"), char_id("="), 2, nl, 1, 5, nl]
    assert tiny_tokenizer.decode(ids) == text
    no_gen = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\n3+4=<|im_end|>\n"


def test_round_trip_of_task_text(tiny_tokenizer) -> None:
    samples = [
        "  leading and trailing spaces  ",
        "a  b\tc\n\nd",
        "Answer: \\boxed{12}",
        "The user asked: it's 3 , isn't it ?",
        "#### 72",
    ] + [row["prompt"][0]["content"] + "12<|im_end|>" for row in make_rows(5, seed=0, ops=("+", "-", "*"))]
    for text in samples:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert UNK_TOKEN_ID not in ids, text
        assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=ASCII_TEXT)
def test_round_trip_any_ascii(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert UNK_TOKEN_ID not in ids
    assert tiny_tokenizer.decode(ids) == text


def test_role_words_are_single_tokens_and_skip_special(tiny_tokenizer) -> None:
    assert tiny_tokenizer.encode("assistant") == [5]
    assert tiny_tokenizer.encode("users") == [4, char_id("s")]
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_extra_texts_add_characters_deterministically(tmp_path) -> None:
    a = build_tiny_tokenizer(tmp_path / "a", extra_texts=["\u00fc\u00e9", "\u00e9"])
    b = build_tiny_tokenizer(tmp_path / "b", extra_texts=["\u00e9\u00fc"])
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == BASE_VOCAB_SIZE + 2
    assert a.convert_tokens_to_ids("\u00e9") == BASE_VOCAB_SIZE  # sorted: é (U+00E9) before ü (U+00FC)
    text = "pr\u00fcfe \u00e9"
    assert a.decode(a.encode(text)) == text
    assert a.eos_token_id == EOS_TOKEN_ID
