"""Reading, validating and writing verl-format rows (parquet and jsonl).

A row is one prompt with its reward information, as verl's preprocessors write it::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],      # or a plain string
     "ability": "math",                                    # optional, not checked
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}         # optional

Every error is a ``DataError`` that names the file, the row index and the field, and says what was expected, so a
bad row in a 17k-row file can be found without a debugger.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

# Rows read by ``load_rows`` carry their origin under this key so that errors raised later (chat template,
# truncation) can still name the file and row. ``write_rows`` drops it.
SOURCE_KEY = "_source"

SUFFIXES = (".parquet", ".jsonl")


class DataError(ValueError):
    """A data file or row is missing, unreadable or not in the expected format."""


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix or '(no suffix)'!r}; expected one of {SUFFIXES}")
    return suffix


def read_records(path: str | Path) -> list[dict]:
    """Read the raw records of one parquet or jsonl file, without validating their fields.

    Each record must be a JSON object / parquet row; blank jsonl lines are skipped.
    """
    path = Path(path)
    suffix = _suffix(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types; all mean "not a readable parquet file"
            raise DataError(f"{path}: cannot read as parquet: {exc}") from exc
    records: list[dict] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: row {len(records)} (line {line_no}): not valid UTF-8 (byte {raw[exc.start]:#04x} at "
                    f"column {exc.start + 1}); jsonl files must be UTF-8 encoded"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {len(records)} (line {line_no}): invalid JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}: row {len(records)} (line {line_no}): expected a JSON object, got {_describe(record)}"
                )
            records.append(record)
    return records


def validate_messages(prompt: Any, where: str, field: str = "prompt") -> None:
    """Check a chat prompt: a non-empty string, or a non-empty list of ``{role: str, content: str}`` messages."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: field {field!r}: expected a non-empty string, got an empty string")
        return
    if not isinstance(prompt, (list, tuple)):
        raise DataError(
            f"{where}: field {field!r}: expected a list of {{role, content}} messages or a string, "
            f"got {_describe(prompt)}"
        )
    if not prompt:
        raise DataError(f"{where}: field {field!r}: expected at least one message, got an empty list")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: field '{field}[{j}]': expected a {{role, content}} mapping, got {_describe(message)}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{where}: field '{field}[{j}].{key}': missing (a message needs role and content)")
            if not isinstance(message[key], str):
                raise DataError(
                    f"{where}: field '{field}[{j}].{key}': expected a string, got {_describe(message[key])}"
                )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def validate_row(row: Any, where: str, prompt_key: str = "prompt") -> None:
    """Check one verl-format row; raise ``DataError`` naming ``where`` (file and row) and the bad field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a row mapping, got {_describe(row)}")
    if prompt_key not in row:
        raise DataError(f"{where}: field {prompt_key!r}: missing (expected the prompt messages or a string)")
    validate_messages(row[prompt_key], where, prompt_key)
    if "data_source" not in row:
        raise DataError(f"{where}: field 'data_source': missing (expected a string naming the reward function)")
    if not isinstance(row["data_source"], str):
        raise DataError(f"{where}: field 'data_source': expected a string, got {_describe(row['data_source'])}")
    reward_model = row.get("reward_model")
    if reward_model is None:
        raise DataError(f"{where}: field 'reward_model': missing (expected a mapping with 'ground_truth')")
    if not isinstance(reward_model, dict):
        raise DataError(f"{where}: field 'reward_model': expected a mapping, got {_describe(reward_model)}")
    if "ground_truth" not in reward_model or reward_model["ground_truth"] is None:
        raise DataError(f"{where}: field 'reward_model.ground_truth': missing (expected a string, number or list)")
    truth = reward_model["ground_truth"]
    if not (isinstance(truth, (str, list, tuple)) or _is_number(truth)):
        raise DataError(
            f"{where}: field 'reward_model.ground_truth': expected a string, number or list, got {_describe(truth)}"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info': expected a mapping, got {_describe(extra)}")


def row_location(row: dict, fallback: str) -> str:
    """Where a row came from ("file: row i"), for error messages; ``fallback`` for rows made in memory."""
    source = row.get(SOURCE_KEY) if isinstance(row, dict) else None
    return source if isinstance(source, str) else fallback


def load_rows(files: str | Sequence[str | Path], prompt_key: str = "prompt") -> list[dict]:
    """Read and validate verl-format rows from parquet / jsonl files, in file order.

    Each returned row carries ``row[SOURCE_KEY] == "<file>: row <i>"`` for later error messages.
    """
    if isinstance(files, (str, Path)):
        files = [files]
    if not files:
        raise DataError("no data files given (data.train_files / data.val_files is empty)")
    rows: list[dict] = []
    for file in files:
        for i, record in enumerate(read_records(file)):
            where = f"{file}: row {i}"
            validate_row(record, where, prompt_key)
            record[SOURCE_KEY] = where
            rows.append(record)
    return rows


def write_rows(path: str | Path, rows: Iterable[dict], prompt_key: str = "prompt") -> Path:
    """Validate ``rows`` and write them as parquet or jsonl (chosen by the suffix); returns the path.

    Parquet needs each column to have one type across rows (e.g. ground truths all strings); a mix is reported as a
    ``DataError`` instead of pyarrow's message.
    """
    path = Path(path)
    suffix = _suffix(path)
    clean: list[dict] = []
    for i, row in enumerate(rows):
        validate_row(row, f"rows to write to {path}: row {i}", prompt_key)
        clean.append({k: v for k, v in row.items() if k != SOURCE_KEY})
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        try:
            table = pa.Table.from_pylist(clean)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"{path}: rows cannot form one parquet table (mixed types in a column?): {exc}") from exc
        pq.write_table(table, path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in clean:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
