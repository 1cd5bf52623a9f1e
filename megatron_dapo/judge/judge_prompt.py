"""What the judge reads: ``reward.judge.prompt_template`` filled with one response's prompt, response and ground
truth (docs/judge.md). Pure: the fields are checked here for the config gate, and filled here for the scorer."""

from __future__ import annotations

import string
from typing import Any

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
REQUIRED_FIELDS = ("response",)


def template_fields(template: str) -> list[str]:
    """The ``{field}`` names ``template`` uses, in order (``ValueError`` for a malformed template, e.g. one lone
    brace; literal braces are written doubled)."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if name == "" or not name.isidentifier() or spec or conversion:
            raise ValueError(f"'{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}'")
        names.append(name)
    return names


def prompt_text(item: dict[str, Any]) -> str:
    """``{prompt}``: the content of the row's last user message (its prompt before any chat template), or the whole
    prompt where the row's prompt is a plain string."""
    messages = item.get("prompt_messages")
    if isinstance(messages, str):
        return messages
    if isinstance(messages, (list, tuple)):
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return str(item.get("raw_prompt", ""))


def fill(template: str, item: dict[str, Any], response: str) -> str:
    """The judge's text for one response to the row ``item`` (the dataset's: prompt messages, ground truth)."""
    truth = item.get("ground_truth")
    return template.format(prompt=prompt_text(item), response=response, ground_truth="" if truth is None else truth)
