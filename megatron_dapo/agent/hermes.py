"""Tool calls in the Hermes format that Qwen2.5/Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2 + 3)"}}
    </tool_call>

``parse_tool_calls`` reads them out of a model turn's *decoded text* (the trained tokens are the sampled ones; the
text is only read). Every ``<tool_call>`` block becomes a ``ToolCall``; a block that is not valid JSON, names no
tool, has arguments that are not an object, or is never closed (the turn hit its budget inside the call) becomes a
``ToolCall`` with ``error`` set, so the caller can answer it with an error message instead of failing. Text inside a
tool *result* is never parsed here: only model turns are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["CALL_CLOSE", "CALL_OPEN", "ToolCall", "parse_tool_calls"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(" + re.escape(CALL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``, or ``error`` saying why the block is not a valid call."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def _call_of(body: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(error=f"the tool call is not closed with {CALL_CLOSE} (the turn ended inside it)")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(error='the tool call must be a JSON object with a "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=obj["name"], error='the tool call\'s "arguments" string is not valid JSON')
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error='the tool call\'s "arguments" must be a JSON object')
    return ToolCall(name=obj["name"], arguments=args)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls in order). No ``<tool_call>``: (text, [])."""
    calls = [_call_of(m.group(1).strip(), bool(m.group(2))) for m in _BLOCK.finditer(text)]
    first = text.find(CALL_OPEN)
    return (text if first < 0 else text[:first]), calls
