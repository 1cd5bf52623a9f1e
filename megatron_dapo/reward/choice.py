"""Multiple-choice reward: the letters in the last ``\\boxed{...}`` must equal the reference letters (1.0 / 0.0).

The boxed content is normalised: TeX wrappers (``\\text{}``, ``\\mathrm{}``, ``\\textbf{}``), parentheses and
separators (commas, semicolons, slashes, ``&``, the word ``and``, whitespace, a trailing period) are dropped,
then every token must be either a single letter (any case) or a run of capital letters (``"AC"`` = A and C).
Anything else (numbers, words such as ``Paris``) makes the answer invalid. Answers are compared as *sets* of
capital letters, so ``"A, C"``, ``"C and A"``, ``"(A)(C)"`` and ``"AC"`` are all equal. The ground truth may be a
string in any of these forms or a list of letters.

Pure Python (runs in reward worker processes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from megatron_dapo.reward.math_dapo import last_boxed_only_string, remove_boxed

__all__ = ["compute_score", "extract_choice", "parse_choices"]

_TEX_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textrm|mbox)\s*\{([^{}]*)\}")
_TEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_AND = re.compile(r"(?i)\band\b")
_SEPARATORS = re.compile(r"[\s,;/&()\[\]{}.:$~]+")


def parse_choices(answer: Any) -> frozenset[str] | None:
    """Set of capital letters named by ``answer`` (string or iterable of strings), or None if it is not a valid
    letter answer (empty, or containing anything but letters and separators)."""
    if answer is None:
        return None
    if not isinstance(answer, str):
        if not isinstance(answer, Iterable):
            return None
        parts = [parse_choices(a) for a in answer]
        if not parts or any(p is None for p in parts):
            return None
        return frozenset().union(*parts)  # type: ignore[arg-type]
    text = answer
    while True:
        unwrapped = _TEX_WRAPPER.sub(r" \1 ", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = _TEX_COMMAND.sub(" ", text)
    text = _AND.sub(" ", text)
    letters: set[str] = set()
    for token in _SEPARATORS.split(text):
        if not token:
            continue
        if len(token) == 1 and token.isascii() and token.isalpha():
            letters.add(token.upper())
        elif token.isascii() and token.isalpha() and token.isupper():
            letters.update(token)
        else:
            return None
    return frozenset(letters) if letters else None


def extract_choice(solution_str: str) -> frozenset[str] | None:
    """Letters in the last ``\\boxed{...}`` of the response, or None (no box / invalid content)."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return None
    return parse_choices(remove_boxed(boxed))


def compute_score(
    solution_str: str, ground_truth: Any, data_source: str | None = None, extra_info: dict | None = None
) -> float:
    """1.0 if the boxed letters equal the ground-truth letters as sets, else 0.0.

    ``data_source`` and ``extra_info`` are ignored; they let this function serve as a custom reward function
    (``reward.custom_function.path=megatron_dapo/reward/choice.py``).
    """
    pred = extract_choice(solution_str)
    gt = parse_choices(ground_truth)
    return 1.0 if pred is not None and gt is not None and pred == gt else 0.0
