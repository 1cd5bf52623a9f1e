"""Hermes/Qwen tool-call parsing (``agent/hermes.py``) on hand-written model turns."""

from __future__ import annotations

from megatron_dapo.agent.hermes import ToolCall, parse_tool_calls


def test_one_call_and_the_text_before_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2+3)"}}\n</tool_call>'
    assert parse_tool_calls(text) == ("Let me compute.\n", [ToolCall("python", {"code": "print(2+3)"})])


def test_no_call():
    assert parse_tool_calls("The answer is 5.") == ("The answer is 5.", [])


def test_two_calls_in_one_turn_keep_their_order():
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": 3}"}</tool_call>'
    )
    _, calls = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("lookup", {"key": 3})]


def test_malformed_calls_become_errors_not_exceptions():
    cases = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': 'a "name" string',
        '<tool_call>["python"]</tool_call>': 'a "name" string',
        '<tool_call>{"name": "python", "arguments": [1]}</tool_call>': '"arguments" must be a JSON object',
        '<tool_call>{"name": "python", "arguments": "{oops"}</tool_call>': '"arguments" string is not valid JSON',
        # truncated: the turn hit its token budget inside the call
        '<tool_call>{"name": "python", "arguments": {"code": "print(': "not closed",
    }
    for text, fragment in cases.items():
        _, (call,) = parse_tool_calls(text)
        assert call.error is not None and fragment in call.error, (text, call)


def test_missing_arguments_are_empty_and_whitespace_is_tolerated():
    _, (call,) = parse_tool_calls('<tool_call>\n  {"name": "clock"}  \n</tool_call>')
    assert call == ToolCall("clock", {})
