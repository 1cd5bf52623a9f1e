"""Turning a row's prompt into text and token ids: chat template and truncation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from megatron_dapo.data.rows import DataError

TRUNCATION_MODES = ("error", "left", "right", "middle")


def prompt_text(
    prompt: Any, tokenizer: Any, apply_chat_template: bool, where: str = "prompt", tools: Optional[list] = None
) -> str:
    """The text fed to the tokenizer for one prompt.

    - a list of messages with ``apply_chat_template``: the tokenizer's chat template with the generation prompt
      added (the assistant turn is opened, as verl does);
    - a plain string: used as is (it is taken to be already formatted, e.g. for a base model);
    - a list of messages without the chat template: the message contents joined by newlines (roles dropped).
    """
    if isinstance(prompt, str):
        return prompt
    if not apply_chat_template:
        return "\n".join(message["content"] for message in prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: the tokenizer has no chat_template; set data.apply_chat_template=false to use the raw text"
        )
    try:
        kwargs = {"tools": tools} if tools else {}  # multi-turn: the tool schemas, as verl passes them
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:  # jinja raises template-defined errors (e.g. "roles must alternate")
        raise DataError(f"{where}: the chat template failed on this prompt: {exc}") from exc
    if not isinstance(text, str):  # some processors return a list for batched input
        raise DataError(f"{where}: apply_chat_template returned {type(text).__name__}, expected a string")
    return text


def truncate_prompt(ids: Sequence[int], max_length: int, mode: str, where: str = "prompt") -> list[int]:
    """Fit ``ids`` into ``max_length`` tokens (verl's semantics).

    ``left`` drops tokens from the start (keeps the end), ``right`` drops them from the end, ``middle`` keeps the
    first ``max_length // 2`` and the last ``max_length - max_length // 2`` tokens, ``error`` raises ``DataError``.
    """
    if mode not in TRUNCATION_MODES:
        raise DataError(f"data.truncation: expected one of {TRUNCATION_MODES}, got {mode!r}")
    if max_length <= 0:
        raise DataError(f"data.max_prompt_length: expected a positive integer, got {max_length}")
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        tail = max_length - head
        return ids[:head] + ids[-tail:]
    raise DataError(
        f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={max_length}; set "
        "data.truncation to left, right or middle, or data.filter_overlong_prompts=true to drop such rows"
    )
