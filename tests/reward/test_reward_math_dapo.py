"""DAPO math scorer: hand-made cases for each branch of verl's math_dapo behaviour."""

from __future__ import annotations

import pytest

from megatron_dapo.reward.math_dapo import (
    compute_score,
    last_boxed_only_string,
    normalize_final_answer,
    remove_boxed,
)


def test_correct_and_wrong_answer_line() -> None:
    assert compute_score("Let me think. 6*7 = 42.\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score("Answer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}


def test_no_answer_line_falls_back_to_the_last_box() -> None:
    # verl 0.9.1: without an "Answer:" line the strict box check decides (raw box content, last 100 characters).
    assert compute_score("The result is \\boxed{42}.", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score("\\boxed{1} or \\boxed{42}", "42")["pred"] == "42"
    # The fallback compares unnormalised: "$42$" is not "42" (the Answer-line path would have normalised it).
    assert compute_score("so \\boxed{$42$}", "42") == {"score": -1.0, "acc": False, "pred": "$42$"}
    # A box 101+ characters before the end is out of the fallback's window.
    assert compute_score("\\boxed{42}" + "." * 95, "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score("The result is 42.", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}


def test_answer_line_wins_over_box() -> None:
    assert compute_score("\\boxed{42}\nAnswer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}


def test_last_answer_line_wins_and_case_insensitive() -> None:
    assert compute_score("Answer: 1\nthen again\nANSWER :  42\n", "42")["acc"] is True
    assert compute_score("answer: 42\nAnswer: 1", "42")["pred"] == "1"


def test_answer_stops_at_end_of_line() -> None:
    assert compute_score("Answer: 42\nbecause 40 + 2", "42")["pred"] == "42"


def test_only_last_300_characters_are_read() -> None:
    assert compute_score("Answer: 42\n" + "x" * 289, "42")["acc"] is True  # 300 characters: whole
    assert compute_score("Answer: 42\n" + "x" * 290, "42")["pred"] == "[INVALID]"  # 301: the "A" is cut off


def test_boxed_inside_answer_line_is_unwrapped() -> None:
    assert compute_score("Answer: $\\boxed{\\frac12}$", "\\frac{1}{2}")["acc"] is True
    assert compute_score("Answer: \\boxed{7}", "7")["acc"] is True


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("1,000", "1000"),  # thousands separator of an integer
        ("1,000.5", "1,000.5"),  # ...only for pure integers
        ("x = 5", "5"),  # text after the last '='
        ("10 degrees", "10"),  # unit words deleted
        ("30^\\circ", "30"),
        ("\\text{(B)}", "(B)"),
        ("\\textbf{12}", "12"),
        ("\\overline{3}", "3"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\dfrac{3}{4}", "\\dfrac{3}{4}"),
        ("$5$ dollars", "5"),
        ("5.$", "5"),
        ("an apple", "apple"),  # articles "an " / "a " are removed
        ("a cat", "cat"),
        ("  7  ", "7"),
    ],
)
def test_normalize_final_answer(raw: str, normalised: str) -> None:
    assert normalize_final_answer(raw) == normalised


def test_ground_truth_is_normalised_too() -> None:
    assert compute_score("Answer: 1000", "1,000")["acc"] is True
    assert compute_score("Answer: 5", 5)["acc"] is True  # non-string ground truths are converted with str


def test_strict_box_mode() -> None:
    assert compute_score("so \\boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    # compared without normalisation
    assert compute_score("so \\boxed{ 42}", "42", strict_box_verify=True)["acc"] is False
    assert compute_score("Answer: 42", "42", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}
    # the box must be within the last 100 characters
    assert compute_score("\\boxed{42}" + "." * 95, "42", strict_box_verify=True)["pred"] is None
    assert compute_score("\\boxed{42}" + "." * 90, "42", strict_box_verify=True)["acc"] is True


def test_last_boxed_only_string() -> None:
    assert last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed_only_string("\\boxed{unclosed {x}") is None
    assert last_boxed_only_string("no box") is None
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="not a"):
        remove_boxed("\\fbox{1}")
