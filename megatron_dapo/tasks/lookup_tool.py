"""The ``lookup`` tool and the reward of the tiny tool-use task (``megatron_dapo/tasks/agent.py``).

Each sample has its own boxes with secret digits, passed to the tool as verl passes per-sample tool arguments: the
row's ``extra_info.tools_kwargs = {"lookup": {"create_kwargs": {"boxes": {"a": 3, "b": 0, "c": 7}}}}`` becomes
``create(instance_id, boxes=...)``. A call ``{"name": "lookup", "arguments": {"box": "c"}}`` is answered with the
digit in that box as text (``"7"``); an unknown box with ``"error: no box x"``. The prompt names a box and the
answer is its digit, which the model can only know from the tool.

A tool YAML names the class as a user file (``prepare`` in ``agent.py`` writes one)::

    tools:
      - class_name: megatron_dapo/tasks/lookup_tool.py:LookupTool
        tool_schema: {type: function, function: {name: lookup, ...}}

and a config points its reward at ``compute_score`` in this file.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dapo.agent.hermes import parse_tool_calls
from megatron_dapo.agent.tools import BaseTool

__all__ = ["LookupTool", "TOOL_NAME", "compute_score", "final_answer"]

TOOL_NAME = "lookup"
_EOS_TEXT = "<|im_end|>"


class LookupTool(BaseTool):
    """``lookup(box)``: the digit in one of the sample's boxes. Step reward 0 (the task's reward is the answer);
    metrics ``{"found": 0 or 1}``."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        super().__init__(config, tool_schema)
        self._boxes: dict[str, dict[str, str]] = {}

    def create(self, instance_id: str, boxes: Optional[dict] = None, **_: Any) -> str:
        # Parquet may hand back a struct with None for boxes some rows lack: drop those.
        self._boxes[instance_id] = {str(k): str(v) for k, v in (boxes or {}).items() if v is not None}
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        boxes = self._boxes.get(instance_id)
        if boxes is None:
            return f"error: no boxes for instance {instance_id!r} (create was not called)", 0.0, {"found": 0}
        box = arguments.get("box") if isinstance(arguments, dict) else None
        if not isinstance(box, str):
            return 'error: the call needs a "box" string argument', 0.0, {"found": 0}
        if box not in boxes:
            return f"error: no box {box}", 0.0, {"found": 0}
        return boxes[box], 0.0, {"found": 1}

    def release(self, instance_id: str) -> None:
        self._boxes.pop(instance_id, None)


def final_answer(solution_str: str, messages: Optional[list] = None) -> str:
    """The last assistant message's content, stripped (``""`` when there is none).

    Without ``messages`` the last assistant turn is read from ``solution_str`` (the whole response text, special
    tokens removed): what follows the last ``</tool_response>`` and the ``assistant`` role word after it, or the
    whole text when no tool answered.
    """
    if messages:
        contents = [m.get("content") or "" for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
        text = contents[-1] if contents else ""
    else:
        text = solution_str or ""
        if "</tool_response>" in text:
            text = text.rsplit("</tool_response>", 1)[1].strip()
            text = text.removeprefix("assistant")
    text = text.strip()
    return text.removesuffix(_EOS_TEXT).strip()


def _called_tool(solution_str: str, messages: Optional[list]) -> bool:
    """Whether the model made a valid ``lookup`` call (with a ``box`` argument) in any assistant turn."""
    turns = (
        [m.get("content") or "" for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
        if messages
        else [solution_str or ""]
    )
    for text in turns:
        _, calls = parse_tool_calls(text)
        if any(c.error is None and c.name == TOOL_NAME and "box" in c.arguments for c in calls):
            return True
    return False


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
) -> dict[str, Any]:
    """1.0 when the last assistant message, stripped, is exactly the ground-truth digit, else 0.0.

    ``extra_info["messages"]`` (the whole conversation, as the multi-turn rollout passes it) is read when present;
    otherwise ``solution_str`` (see ``final_answer``). A final turn that is still a tool call, or ``"7 "`` + more
    text, scores 0. Returns ``{"score", "acc", "pred", "called_tool"}``; ``called_tool`` is whether some assistant
    turn holds a valid ``lookup`` call.
    """
    messages = (extra_info or {}).get("messages")
    messages = list(messages) if messages is not None and len(messages) else None
    pred = final_answer(solution_str, messages)
    acc = bool(pred) and pred == str(ground_truth).strip()
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": pred, "called_tool": _called_tool(solution_str, messages)}
