#!/usr/bin/env python
"""GSM8K jsonl (``question``, ``answer`` ending in ``#### 72``) -> verl-format rows (verl's gsm8k preprocessing).

python tools/data/gsm8k.py --input train.jsonl --output data/gsm8k/train.parquet --split train
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    from megatron_dapo.data.rows import DataError, read_records, write_rows
except ImportError:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_dapo.data.rows import DataError, read_records, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str | None:
    """The number after ``####`` with thousands separators removed (``"1,000"`` -> ``"1000"``); None if absent."""
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def convert(records: list[dict], split: str, source: str) -> list[dict]:
    rows = []
    for i, record in enumerate(records):
        where = f"{source}: row {i}"
        for key in ("question", "answer"):
            if key not in record:
                raise DataError(f"{where}: field {key!r}: missing (expected a string)")
            if not isinstance(record[key], str):
                raise DataError(f"{where}: field {key!r}: expected a string, got {type(record[key]).__name__}")
        solution = extract_solution(record["answer"])
        if solution is None:
            raise DataError(f"{where}: field 'answer': expected a final line '#### <number>', found none")
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": record["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {"split": split, "index": i, "answer": record["answer"], "question": record["question"]},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="GSM8K jsonl (or parquet) with question and answer fields")
    parser.add_argument("--output", required=True, help="output .parquet or .jsonl")
    parser.add_argument("--split", default="train", help="stored in extra_info.split")
    args = parser.parse_args(argv)
    try:
        rows = convert(read_records(args.input), args.split, args.input)
        write_rows(args.output, rows)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
