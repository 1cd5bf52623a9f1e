"""Synthetic one-step arithmetic: prompts like ``3+4=`` with the answer ``7``.

It exists to show an RL curve rising on CPU with a tiny model: the prompt is a handful of tokens, operands are
single digits by default, so the answer space is small (sums 0-18) and a policy can learn it in few steps.

``compute_score`` and ``compute_score_exact`` have the custom reward function signature, so a config can point at
either::

    reward.custom_function.path: megatron_dapo/tasks/arithmetic.py
    reward.custom_function.name: compute_score_exact

``compute_score`` (first number wins) is lenient; ``compute_score_exact`` (the whole completion must be the answer) is
what an RL run should use: with the lenient one ``"7junk"`` is correct, so stopping is never rewarded, while wrong
*finished* answers push EOS down, and a tiny policy stops emitting EOS (docs/cpu_stack.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.data.rows import write_rows

DATA_SOURCE = "arithmetic"
OPS = ("+", "-", "*")
_NUMBER = re.compile(r"-?\d+")


def make_rows(n: int, seed: int, max_operand: int = 9, ops: Sequence[str] = ("+",), split: str = "train") -> list[dict]:
    """``n`` verl-format rows ``a<op>b=`` with operands in ``0..max_operand``, drawn with ``random.Random(seed)``.

    For ``-`` the larger operand comes first, so answers are never negative (fewer answer tokens to learn).
    """
    if n < 0:
        raise ValueError(f"make_rows: n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"make_rows: max_operand must be >= 0, got {max_operand}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"make_rows: ops must be a non-empty subset of {OPS}, got {tuple(ops)}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        op = rng.choice(list(ops))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": i, "split": split},
            }
        )
    return rows


def make_table_rows(max_operand: int = 9, ops: Sequence[str] = ("+",), split: str = "val") -> list[dict]:
    """Every distinct prompt ``a<op>b=`` with operands in ``0..max_operand`` once, in a fixed order (op, a, b).

    Rows have the ``make_rows`` format. A validation set made of the whole table measures the accuracy on the task
    itself, with no sampling noise from which prompts happened to be drawn. For ``-`` only ``a >= b`` is listed
    (``make_rows`` swaps operands so that answers are never negative), so each distinct prompt appears once.
    """
    if max_operand < 0:
        raise ValueError(f"make_table_rows: max_operand must be >= 0, got {max_operand}")
    if not ops or any(op not in OPS for op in ops):
        raise ValueError(f"make_table_rows: ops must be a non-empty subset of {OPS}, got {tuple(ops)}")
    rows = []
    for op in dict.fromkeys(ops):  # keeps the order, drops repeats
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and a < b:
                    continue
                answer = a + b if op == "+" else a - b if op == "-" else a * b
                rows.append(
                    {
                        "data_source": DATA_SOURCE,
                        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                        "ability": "arithmetic",
                        "reward_model": {"style": "rule", "ground_truth": str(answer)},
                        "extra_info": {"index": len(rows), "split": split},
                    }
                )
    return rows


def write_dataset(path: str | Path, rows: Sequence[dict]) -> Path:
    """Write rows as parquet or jsonl, chosen by the suffix of ``path``."""
    return write_rows(path, rows)


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, Any]:
    """Rule reward: 1.0 when the first integer in the completion equals the ground truth, else 0.0.

    The completion is stripped of surrounding whitespace and the first match of ``-?\\d+`` is the prediction, so
    ``" 7<|im_end|>"`` and ``"7 is the answer"`` score for ``7``, while ``"17"``, ``"07"`` and ``"seven"`` do not:
    the comparison is an exact string match (no numeric normalisation), which keeps the target unambiguous.
    Returns ``{"score": float, "acc": bool, "pred": str}`` (``pred`` is ``""`` when there is no number).
    """
    match = _NUMBER.search(solution_str.strip())
    pred = match.group(0) if match else ""
    acc = bool(pred) and pred == str(ground_truth).strip()
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": pred}


def compute_score_exact(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, Any]:
    """Exact-match rule reward: 1.0 when the whole completion, stripped of surrounding whitespace, is the answer.

    ``"7"``, ``" 7\n"`` score for ``7``; ``"7junk"``, ``"7 is it"``, ``"17"``, ``"07"`` and ``""`` do not. The reward
    manager has already removed the EOS token (and other special tokens) from ``solution_str``, so a policy is
    rewarded for answering *and then stopping*. Returns ``{"score": float, "acc": bool, "pred": str}`` where
    ``pred`` is the stripped completion.
    """
    pred = solution_str.strip()
    acc = bool(pred) and pred == str(ground_truth).strip()
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": pred}
