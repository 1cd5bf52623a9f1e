"""Refuse a teacher whose tokenizer is not the student's: the teacher scores the student's token ids, so a different
vocabulary would score other tokens than those sampled, silently (verl does not check this)."""

from __future__ import annotations

from typing import Any

from megatron_dapo.errors import ConfigError

SAMPLE_SIZE = 256  # ids compared spread over the vocabulary, plus the last TAIL ids (where added tokens go)
TAIL = 32
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")

__all__ = ["check_same_tokenizer", "tokenizer_mismatches"]


def _special_ids(tokenizer: Any) -> dict[str, Any]:
    ids: dict[str, Any] = {f"{role}_token_id": getattr(tokenizer, f"{role}_token_id", None) for role in SPECIAL_ROLES}
    ids["all_special_ids"] = sorted(getattr(tokenizer, "all_special_ids", []) or [])
    return ids


def _sample_ids(size: int, sample_size: int) -> list[int]:
    step = max(1, size // sample_size)
    return sorted(set(range(0, size, step)) | set(range(max(0, size - TAIL), size)))


def tokenizer_mismatches(
    student: Any, teacher: Any, student_name: str, teacher_name: str, sample_size: int = SAMPLE_SIZE
) -> list[str]:
    """How the two HF tokenizers differ: vocabulary size (``len``), special token ids, and the tokens of a sample of
    ids (spread over the vocabulary and its last ids); one line each, naming both. Empty when they agree."""
    pair = f"student tokenizer ({student_name}) vs teacher tokenizer ({teacher_name})"
    problems = []
    sizes = (len(student), len(teacher))
    if sizes[0] != sizes[1]:
        problems.append(f"{pair}: vocabulary size {sizes[0]} vs {sizes[1]}")
    specials = (_special_ids(student), _special_ids(teacher))
    for key in specials[0]:
        if specials[0][key] != specials[1][key]:
            problems.append(f"{pair}: {key} {specials[0][key]} vs {specials[1][key]}")
    ids = _sample_ids(min(sizes), sample_size)
    tokens = (student.convert_ids_to_tokens(ids), teacher.convert_ids_to_tokens(ids))
    differ = [(i, a, b) for i, a, b in zip(ids, *tokens) if a != b]
    if differ:
        shown = ", ".join(f"id {i}: {a!r} vs {b!r}" for i, a, b in differ[:5])
        problems.append(f"{pair}: {len(differ)} of {len(ids)} sampled ids map to other tokens ({shown})")
    return problems


def check_same_tokenizer(student: Any, teacher: Any, student_name: str, teacher_name: str) -> None:
    """Raise ``ConfigError`` listing every :func:`tokenizer_mismatches` line: on-policy distillation needs the
    teacher to read the student's token ids as the same tokens."""
    problems = tokenizer_mismatches(student, teacher, student_name, teacher_name)
    if problems:
        raise ConfigError.of(
            problems + ["on-policy distillation needs a teacher with the student's tokenizer (the same vocabulary)"]
        )
