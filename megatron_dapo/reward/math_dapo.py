"""DAPO math reward: +1 / -1 by exact match of the final answer.

Reproduces verl 0.9.1's ``math_dapo.compute_score`` (itself adapted from the Minerva/lm-eval-harness
normalisation) exactly, on the same strings (``tests/algo/test_verl_golden.py`` checks score, ``acc`` and ``pred``
against verl's own output):

* only the last 300 characters of the response are looked at;
* default mode: the text after the *last* ``Answer:`` (case-insensitive, up to the end of the line) is the
  prediction; prediction and ground truth are normalised by :func:`normalize_final_answer` and compared as
  strings. A ``\\boxed{...}`` inside the answer line is unwrapped by the normalisation, so ``Answer: \\boxed{5}``
  matches ``5``. When that prediction normalises to ``"[INVALID]"`` (no ``Answer:`` line), the strict box check
  below is the fallback; if it finds no box either, the result is wrong with ``pred == "[INVALID]"``;
* strict-box check (``strict_box_verify=True``, or the fallback): the last ``\\boxed{...}`` within the last 100
  characters (of the 300) is the prediction, compared *unnormalised* with the ground truth; ``pred`` is None when
  there is no box.

Pure Python, no third-party imports (it runs in reward worker processes).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["compute_score", "last_boxed_only_string", "normalize_final_answer", "remove_boxed"]

SOLUTION_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters
STRICT_BOX_TAIL_CHARS = 100
INVALID_ANSWER = "[INVALID]"
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOX_OPEN = "\\boxed{"

# Literal replacements, applied in order (same table as the Minerva normalisation).
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units and TeX noise deleted after the replacements, in order.
_DELETIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
# Regex rewrites, in order: keep the first $...$ span of a line; unwrap \text{}, \textbf{}, \overline{} (first
# closing brace) and \boxed{} (greedy, last closing brace); expand \fracab -> \frac{a}{b} and \sqrta -> \sqrt{a}.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), repl)
    for pattern, repl in (
        (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
        (r"(\\text\{)(.*?)(\})", r"\2"),
        (r"(\\textbf\{)(.*?)(\})", r"\2"),
        (r"(\\overline\{)(.*?)(\})", r"\2"),
        (r"(\\boxed\{)(.*)(\})", r"\2"),
        (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
        (r"(sqrt)([^{])", r"sqrt{\2}"),
    )
)


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` with balanced braces (including the wrapper), or None.

    Braces are counted from the ``\\boxed{`` opening; an unclosed box gives None.
    """
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for pos in range(start, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start : pos + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """Content of a ``\\boxed{...}`` string (as returned by :func:`last_boxed_only_string`)."""
    if not (boxed.startswith(_BOX_OPEN) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} string: {boxed!r}")
    return boxed[len(_BOX_OPEN) : -1]


def normalize_final_answer(final_answer: str) -> str:
    """Normalise a final answer for exact comparison (Minerva rules, as verl's math_dapo).

    Keeps the part after the last ``=``, applies the replacement/deletion tables and regex rewrites, removes ``$``,
    drops thousands separators from pure integers (``"1,000" -> "1000"``) and strips surrounding whitespace.
    """
    answer = final_answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for junk in _DELETIONS:
        answer = answer.replace(junk, "")
    for pattern, repl in _REWRITES:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _minerva_verify(solution: str, ground_truth: str) -> tuple[bool, str]:
    matches = _ANSWER_RE.findall(solution)
    pred = normalize_final_answer(matches[-1] if matches else INVALID_ANSWER)
    return pred == normalize_final_answer(ground_truth), pred


def _strict_box_verify(solution: str, ground_truth: str) -> tuple[bool, str | None]:
    boxed = last_boxed_only_string(solution[-STRICT_BOX_TAIL_CHARS:])
    pred = remove_boxed(boxed) if boxed is not None else None
    return pred == ground_truth, pred


def _verify(solution: str, ground_truth: str, strict_box_verify: bool) -> tuple[bool, str | None]:
    """verl's ``verify``: ``Answer:`` line first, then the strict box check when there is no answer line."""
    if strict_box_verify:
        return _strict_box_verify(solution, ground_truth)
    correct, pred = _minerva_verify(solution, ground_truth)
    if pred != INVALID_ANSWER:
        return correct, pred
    box_correct, box_pred = _strict_box_verify(solution, ground_truth)
    if box_pred is not None:
        return box_correct, box_pred
    return correct, pred


def compute_score(
    solution_str: str,
    ground_truth: Any,
    strict_box_verify: bool = False,
    data_source: str | None = None,
    extra_info: dict | None = None,
) -> dict[str, Any]:
    """Score one response.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer (converted with ``str``).
        strict_box_verify: use only the strict ``\\boxed{}`` check (no ``Answer:`` extraction).
        data_source, extra_info: ignored (custom-reward-function signature compatibility).

    Returns:
        ``{"score": 1.0 or -1.0, "acc": bool, "pred": prediction}``: the normalised ``Answer:`` text, else the
        raw content of the last box in the last 100 characters, else ``"[INVALID]"`` (``None`` in strict mode).
    """
    tail = solution_str[-SOLUTION_TAIL_CHARS:]
    correct, pred = _verify(tail, str(ground_truth), strict_box_verify)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
