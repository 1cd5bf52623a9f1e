#!/usr/bin/env python
"""DAPO-Math-17k-style data -> verl-format rows with ``data_source="math_dapo"`` and the DAPO prompt wrapper.

Input (parquet or jsonl), either form per row:

- verl format: ``prompt`` (messages or a string) and ``reward_model.ground_truth`` (as the DAPO-Math-17k release);
  the last user message is wrapped in the DAPO instruction unless it already is (or ``--no-wrap``);
- ``question`` (or ``problem``) and ``answer``: the question is wrapped and becomes the single user message.

The released DAPO-Math-17k parquet repeats each problem many times; ``--dedup`` (default) keeps the first row of
each distinct prompt.

    python tools/data/dapo_math.py --input dapo-math-17k.parquet --output data/dapo/train.parquet
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

try:
    from megatron_dapo.data.rows import DataError, read_records, validate_messages, write_rows
except ImportError:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_dapo.data.rows import DataError, read_records, validate_messages, write_rows

logger = logging.getLogger("dapo_math")

DATA_SOURCE = "math_dapo"
PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def wrap_problem(problem: str) -> str:
    """The DAPO recipe's prompt around a bare problem statement."""
    return PROMPT_PREFIX + problem + PROMPT_SUFFIX


def _answer_text(value: Any, where: str, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r}: expected a string or number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: field {field!r}: expected a non-empty answer, got an empty string")
    return text


def convert_record(record: dict, where: str, wrap: bool) -> tuple[list[dict], str]:
    """(prompt messages, ground truth) of one input record."""
    if "prompt" in record:
        prompt = record["prompt"]
        validate_messages(prompt, where)
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [{"role": m["role"], "content": m["content"]} for m in prompt]
        )
        reward_model = record.get("reward_model")
        if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
            truth = _answer_text(reward_model["ground_truth"], where, "reward_model.ground_truth")
        elif record.get("answer") is not None:
            truth = _answer_text(record["answer"], where, "answer")
        else:
            raise DataError(f"{where}: field 'reward_model.ground_truth': missing (or give an 'answer' field)")
        if wrap:
            users = [j for j, m in enumerate(messages) if m["role"] == "user"]
            if not users:
                raise DataError(f"{where}: field 'prompt': expected a message with role 'user' to wrap")
            last = messages[users[-1]]
            if not last["content"].startswith(PROMPT_PREFIX):
                last["content"] = wrap_problem(last["content"])
        return messages, truth
    key = "question" if "question" in record else "problem" if "problem" in record else None
    if key is None:
        raise DataError(
            f"{where}: field 'prompt': missing; expected either 'prompt' (verl format) or 'question'/'problem' "
            f"with 'answer' (fields present: {sorted(record)})"
        )
    if not isinstance(record[key], str) or not record[key].strip():
        raise DataError(f"{where}: field {key!r}: expected a non-empty string, got {record[key]!r}")
    if "answer" not in record:
        raise DataError(f"{where}: field 'answer': missing (expected the final answer)")
    truth = _answer_text(record["answer"], where, "answer")
    content = wrap_problem(record[key]) if wrap else record[key]
    return [{"role": "user", "content": content}], truth


def convert(
    records: list[dict], split: str, source: str, wrap: bool = True, dedup: bool = True, max_rows: int | None = None
) -> list[dict]:
    rows: list[dict] = []
    seen: set[tuple] = set()
    duplicates = 0
    for i, record in enumerate(records):
        where = f"{source}: row {i}"
        messages, truth = convert_record(record, where, wrap)
        key = tuple((m["role"], m["content"]) for m in messages)
        if dedup and key in seen:
            duplicates += 1
            continue
        seen.add(key)
        extra = record.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise DataError(f"{where}: field 'extra_info': expected a mapping, got {type(extra).__name__}")
        extra = dict(extra or {})
        # The release's extra_info.index is a uuid string; keep it under another name, ours is the row number.
        if "index" in extra:
            extra["source_index"] = str(extra.pop("index"))
        extra.update({"split": split, "index": len(rows)})
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": messages,
                "ability": "MATH",
                "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": truth},
                "extra_info": extra,
            }
        )
        if max_rows is not None and len(rows) >= max_rows:
            break
    if duplicates:
        logger.warning("%s: dropped %d duplicate prompts", source, duplicates)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="DAPO-Math-style parquet or jsonl")
    parser.add_argument("--output", required=True, help="output .parquet or .jsonl")
    parser.add_argument("--split", default="train", help="stored in extra_info.split")
    parser.add_argument(
        "--wrap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the DAPO instruction around prompts that lack it",
    )
    parser.add_argument(
        "--dedup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep only the first row of each distinct prompt",
    )
    parser.add_argument("--max-rows", type=int, default=None, help="stop after this many output rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        rows = convert(read_records(args.input), args.split, args.input, args.wrap, args.dedup, args.max_rows)
        write_rows(args.output, rows)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
