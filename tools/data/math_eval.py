#!/usr/bin/env python
r"""MATH-500 / AIME-style evaluation files -> verl-format rows scored by the built-in math_dapo verifier.

Input: jsonl, parquet, or a JSON list of objects. Per row:

- the problem: ``problem`` or ``question`` (any capitalisation, e.g. AIME releases' ``Problem``);
- the answer: ``answer`` (a string or a number, e.g. AIME's integer answers), or else the content of the last
  ``\boxed{...}`` of ``solution`` (the original MATH release has only the worked solution);
- other scalar fields (``unique_id``, ``subject``, ``level``, ``id``, ``year``, ...) are kept in ``extra_info``.

The prompt is the problem in the DAPO instruction (the one ``tools/data/dapo_math.py`` writes, which asks for an
``Answer:`` line, as the math_dapo scorer expects), or the bare problem with ``--no-wrap``. ``--data-source``
names the benchmark in the eval report; it should route to the built-in scorer (``math``, ``math_dapo``,
``math_dapo_reasoning`` or a name starting with ``aime``), otherwise a reward.custom_function must handle it.

    python tools/data/math_eval.py --input math500.jsonl --output data/eval/math500.parquet --data-source math
    python tools/data/math_eval.py --input aime_2024.parquet --output data/eval/aime2024.parquet --data-source aime2024
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

try:
    from megatron_dapo.data.rows import DataError, read_records, write_rows
    from megatron_dapo.reward.manager import route_data_source
except ImportError:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_dapo.data.rows import DataError, read_records, write_rows
    from megatron_dapo.reward.manager import route_data_source


def _sibling(name: str):
    """A module of this directory (tools/data is not a package): the DAPO prompt lives once, in dapo_math.py."""
    spec = importlib.util.spec_from_file_location(f"tools_data_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wrap_problem = _sibling("dapo_math").wrap_problem
last_boxed = _sibling("instruction_json").last_boxed

PROBLEM_KEYS = ("problem", "question")
_SCALARS = (str, int, float, bool)


def read_input(path: str) -> list[dict]:
    """Records of a jsonl/parquet file (``read_records``) or of a ``.json`` file holding a list of objects."""
    file = Path(path)
    if file.suffix.lower() != ".json":
        return read_records(file)
    if not file.is_file():
        raise DataError(f"{path}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{path}: row {i}: expected an object with problem and answer fields, got {record!r:.60}")
    return data


def _field(record: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    """(key, value) of the first of ``names`` present in ``record``, matching keys case-insensitively."""
    lowered = {str(k).lower(): k for k in record}
    for name in names:
        if name in lowered:
            key = lowered[name]
            return key, record[key]
    return None, None


def _answer(record: dict, where: str) -> str:
    key, value = _field(record, ("answer",))
    if key is not None and value is not None and not (isinstance(value, str) and not value.strip()):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: field {key!r}: expected a string or number, got {type(value).__name__}")
        return str(value).strip()
    skey, solution = _field(record, ("solution",))
    if skey is None:
        raise DataError(
            f"{where}: field 'answer': missing; expected 'answer' or a 'solution' with a \\boxed{{...}} answer "
            f"(fields present: {sorted(record)})"
        )
    if not isinstance(solution, str):
        raise DataError(f"{where}: field {skey!r}: expected a string, got {type(solution).__name__}")
    boxed = last_boxed(solution)
    if boxed is None or not boxed.strip():
        raise DataError(f"{where}: field {skey!r}: expected a non-empty \\boxed{{...}} answer, found none")
    return boxed.strip()


def convert(records: list[dict], split: str, source: str, data_source: str, wrap: bool = True) -> list[dict]:
    rows = []
    for i, record in enumerate(records):
        where = f"{source}: row {i}"
        key, problem = _field(record, PROBLEM_KEYS)
        if key is None:
            raise DataError(
                f"{where}: field 'problem': missing; expected 'problem' or 'question' (fields present: "
                f"{sorted(record)})"
            )
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: field {key!r}: expected a non-empty string, got {problem!r:.60}")
        answer = _answer(record, where)
        extra = {
            str(k): v
            for k, v in record.items()
            if str(k).lower() not in PROBLEM_KEYS + ("answer", "solution") and isinstance(v, _SCALARS)
        }
        extra.update({"split": split, "index": i})
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": wrap_problem(problem) if wrap else problem}],
                "ability": "MATH",
                "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": answer},
                "extra_info": extra,
            }
        )
    if not rows:
        raise DataError(f"{source}: no rows")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="jsonl, parquet or JSON list with problem/answer(/solution)")
    parser.add_argument("--output", required=True, help="output .parquet or .jsonl")
    parser.add_argument("--data-source", default="math", help="benchmark name in the report (default: math)")
    parser.add_argument("--split", default="test", help="stored in extra_info.split")
    parser.add_argument(
        "--wrap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="put the problem in the DAPO instruction (ask for an 'Answer:' line)",
    )
    args = parser.parse_args(argv)
    try:
        rows = convert(read_input(args.input), args.split, args.input, args.data_source, args.wrap)
        write_rows(args.output, rows)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if route_data_source(args.data_source) != "math_dapo":
        print(
            f"warning: data_source {args.data_source!r} is not scored by the built-in math verifier (math, math_dapo,"
            " math_dapo_reasoning, aime*); configure reward.custom_function for it",
            file=sys.stderr,
        )
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
