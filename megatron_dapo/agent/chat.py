"""Tool turns as tokens, written by the tokenizer's own chat template.

After a model turn that called tools, the conversation goes on with the tools' results (role ``tool``) and a new
assistant turn. What those tokens are is the chat template's business (Qwen2.5 wraps results in
``<tool_response>`` inside a user turn; other templates differ), so they are rendered by the template itself and
never hand-written: the template renders a reference conversation whose assistant turn holds a sentinel, then the
same conversation with the tool messages and the generation prompt; the text after the sentinel is what follows a
model turn. The model's turn ended with a stop token that the template writes right after the content (``<|im_end|>``
for ChatML); it was sampled already, so it is dropped from the tail.

Only this tail is tokenized; the model's own tokens are never decoded and re-encoded for training (token in, token
out). Tool text is cut to ``max_chars`` characters first (verl's ``max_tool_response_length`` and
``tool_response_truncate_side``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ToolTurns", "truncate_text"]

_SENTINEL = "\x1fMDAPO-ASSISTANT-TURN\x1f"


def truncate_text(text: str, max_chars: int, side: str = "middle") -> str:
    """``text`` cut to ``max_chars`` characters: keep the start (``right``: cut on the right), the end (``left``),
    or both halves with ``...`` between (``middle``)."""
    if len(text) <= max_chars:
        return text
    if side == "right":
        return text[:max_chars] + "..."
    if side == "left":
        return "..." + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + "..." + text[len(text) - (max_chars - half) :]


class ToolTurns:
    """Renders tool results as the tokens that follow a model turn (module docstring)."""

    def __init__(self, tokenizer: Any, max_chars: int = 256, truncate_side: str = "middle") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollout needs a tokenizer with a chat_template: it renders the tool turns")
        self.tokenizer, self.max_chars, self.truncate_side = tokenizer, int(max_chars), truncate_side
        eos = tokenizer.eos_token
        self.stop_text = eos if isinstance(eos, str) else ""
        self.tail(["probe"])  # a template that cannot render tool messages fails here, at start-up

    def texts(self, results: Sequence[str]) -> list[str]:
        """The tool texts as the model will see them (truncated)."""
        return [truncate_text(str(r), self.max_chars, self.truncate_side) for r in results]

    def tail(self, results: Sequence[str]) -> str:
        """The text between a model turn's stop token and the next assistant turn's first sampled token."""
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
        messages += [{"role": "tool", "content": text} for text in results]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if _SENTINEL not in rendered:
            raise ValueError("the chat template dropped the assistant turn's content; cannot place tool turns")
        tail = rendered.split(_SENTINEL, 1)[1]
        return tail[len(self.stop_text) :] if self.stop_text and tail.startswith(self.stop_text) else tail

    def tokens(self, results: Sequence[str]) -> list[int]:
        """The tool turn's token ids (``results`` already truncated by ``texts``)."""
        return list(self.tokenizer.encode(self.tail(results), add_special_tokens=False))
