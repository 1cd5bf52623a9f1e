#!/usr/bin/env python
r"""Instruction JSON (a list of ``{instruction, input, output}``) -> verl-format rows, answer = ``\boxed{...}``.

The prompt is the instruction, followed by a blank line and the input when the input is non-empty. The ground
truth is the content of the last ``\boxed{...}`` in ``output`` (nested braces allowed), stripped.

    python tools/data/instruction_json.py --input fin.json --output data/fin/train.parquet
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

try:
    from megatron_dapo.data.rows import DataError, write_rows
except ImportError:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_dapo.data.rows import DataError, write_rows


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\boxed {...}``) in ``text`` with balanced braces; None if there is
    none or it is open. Shared with ``tools/data/math_eval.py``."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\boxed {"))
    if start < 0:
        return None
    begin = text.index("{", start) + 1
    depth = 0
    for pos in range(begin, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            if depth == 0:
                return text[begin:pos]
            depth -= 1
    return None


def read_json_list(path: str) -> list[Any]:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{path}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise DataError(
            f"{path}: expected a JSON list of {{instruction, input, output}} objects, got {type(data).__name__}"
        )
    return data


def convert(records: list[Any], data_source: str, ability: str, split: str, source: str) -> list[dict]:
    rows = []
    for i, record in enumerate(records):
        where = f"{source}: row {i}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object with instruction, input, output; got {type(record).__name__}")
        for key in ("instruction", "output"):
            if key not in record:
                raise DataError(f"{where}: field {key!r}: missing (expected a string)")
        for key in ("instruction", "input", "output"):
            if key in record and record[key] is not None and not isinstance(record[key], str):
                raise DataError(f"{where}: field {key!r}: expected a string, got {type(record[key]).__name__}")
        if not record["instruction"].strip():
            raise DataError(f"{where}: field 'instruction': expected a non-empty string")
        answer = last_boxed(record["output"])
        if answer is None or not answer.strip():
            raise DataError(f"{where}: field 'output': expected a non-empty \\boxed{{...}} answer, found none")
        extra_input = record.get("input") or ""
        content = record["instruction"] + ("\n\n" + extra_input if extra_input.strip() else "")
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": content}],
                "ability": ability,
                "reward_model": {"style": "rule", "ground_truth": answer.strip()},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSON file: a list of {instruction, input, output}")
    parser.add_argument("--output", required=True, help="output .parquet or .jsonl")
    parser.add_argument("--data-source", default="financial_choice", help="data_source of every row")
    parser.add_argument("--ability", default="choice", help="ability of every row")
    parser.add_argument("--split", default="train", help="stored in extra_info.split")
    args = parser.parse_args(argv)
    try:
        rows = convert(read_json_list(args.input), args.data_source, args.ability, args.split, args.input)
        write_rows(args.output, rows)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
