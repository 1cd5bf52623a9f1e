"""The tokenizer and the token ids every entry point agrees on: where the tokenizer comes from, the padding id, the
stop (EOS) ids and how responses are decoded for logs and reports. The trainer and ``eval`` both use these, so a
validation inside training and an ``eval`` of its checkpoint see the same prompts, stops and texts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

PathLike = Union[str, Path]


@dataclass(frozen=True)
class TokenIds:
    pad: int  # the tokenizer's pad id, else 0 (padding positions are masked everywhere, so any id works)
    eos: tuple[int, ...]  # the tokenizer's EOS id(s): generation stops at any of them


def load_tokenizer(tokenizer_dir: Optional[PathLike], hf_dir: PathLike) -> Any:
    """``model.tokenizer_dir`` when set, else the model's HF directory."""
    from transformers import AutoTokenizer  # heavy: transformers, only for processes that tokenize

    return AutoTokenizer.from_pretrained(str(tokenizer_dir or hf_dir))


def token_ids(tokenizer: Any) -> TokenIds:
    eos = tokenizer.eos_token_id
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return TokenIds(pad=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, eos=eos_ids)


def decode_responses(tokenizer: Any, responses: torch.Tensor, lengths: Sequence[int]) -> list[str]:
    """Each response's first ``length`` tokens as text, special tokens dropped (rollout dumps, eval reports)."""
    return tokenizer.batch_decode(
        [row[: int(n)] for row, n in zip(responses.tolist(), lengths)], skip_special_tokens=True
    )
