"""The judge's score parsers, by name (``reward.judge.parser``): each turns the judge's answer text into a float, or
None when the answer holds no score (the response then scores ``reward.error_score`` and is counted). Pure."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Optional

Parser = Callable[[str], Optional[float]]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def last_number(text: str) -> Optional[float]:
    """The last number written in ``text`` (``8``, ``-1.5``, ``7/10`` reads 10: ask for the number only)."""
    found = _NUMBER.findall(text)
    return _finite(float(found[-1])) if found else None


def regex_parser(pattern: str) -> Parser:
    """The first match of ``pattern``: its first group if it has one, else the whole match, as a float."""
    compiled = re.compile(pattern)

    def parse(text: str) -> Optional[float]:
        match = compiled.search(text)
        if match is None:
            return None
        try:
            return _finite(float(match.group(1) if compiled.groups else match.group(0)))
        except ValueError:
            return None

    return parse


def choice_parser(choices: Mapping[str, float]) -> Parser:
    """The score of the label found earliest in ``text`` as a whole word (a longer label first where two start at
    the same place), e.g. ``{"GOOD": 1, "BAD": 0}``."""
    labels = sorted(choices, key=len, reverse=True)
    compiled = re.compile("|".join(rf"(?<!\w){re.escape(label)}(?!\w)" for label in labels))

    def parse(text: str) -> Optional[float]:
        match = compiled.search(text)
        return float(choices[match.group(0)]) if match else None

    return parse


# name -> what it needs from reward.judge (pattern / choices) -> the parser
PARSERS: dict[str, Callable[[Optional[str], Mapping[str, float]], Parser]] = {
    "last_number": lambda pattern, choices: last_number,
    "regex": lambda pattern, choices: regex_parser(pattern or ""),
    "choice": lambda pattern, choices: choice_parser(choices),
}


def build_parser(name: str, pattern: Optional[str], choices: Mapping[str, float]) -> Parser:
    """The parser ``name`` of ``PARSERS`` (the config gate has checked the name and what it needs)."""
    return PARSERS[name](pattern, choices)


def clamped(score: Optional[float], score_range: Optional[list[float]]) -> Optional[float]:
    """``score`` clamped into ``[low, high]`` (unchanged without a range; None stays None)."""
    if score is None or not score_range:
        return score
    return min(max(score, float(score_range[0])), float(score_range[1]))
