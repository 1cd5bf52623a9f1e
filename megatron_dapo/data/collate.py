"""Padding prompts (left) and responses (right) into tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_dapo.data.rows import DataError


def collate_prompts(items: Sequence[dict], pad_token_id: int, pad_to: int | None = None) -> dict[str, Any]:
    """Stack ``RLDataset`` items into a batch.

    ``input_ids`` are **left**-padded to the longest prompt (or ``pad_to``) so that every prompt ends at the last
    column and responses can be appended right after it. Returns ``input_ids``, ``attention_mask`` (1 on real
    tokens) and ``position_ids`` (0 at each prompt's first real token, 0 on padding), all int64 ``[B, P]``; the
    unpadded ids as ``raw_prompt_ids``; and every other item field as a list.
    """
    if not items:
        raise DataError("collate_prompts: empty batch")
    lengths = [len(item["input_ids"]) for item in items]
    width = max(lengths)
    if pad_to is not None:
        if pad_to < width:
            raise DataError(f"collate_prompts: a prompt has {width} tokens, more than pad_to={pad_to}")
        width = pad_to
    batch = len(items)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, (item, n) in enumerate(zip(items, lengths)):
        if n:
            input_ids[row, width - n :] = torch.tensor(item["input_ids"], dtype=torch.long)
            attention_mask[row, width - n :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    out: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "raw_prompt_ids": [list(item["input_ids"]) for item in items],
    }
    for key in items[0]:
        if key != "input_ids":
            out[key] = [item.get(key) for item in items]
    return out


def pad_responses(
    responses: Sequence[Sequence[int]], pad_token_id: int, max_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad response token lists into ``(response_ids, response_mask)``, both int64 ``[B, T]``.

    ``T`` is the longest response, or ``max_length`` when given (a fixed width keeps tensor shapes stable across
    steps); a response longer than ``max_length`` is an error, since cutting it here would hide a generation bug.
    """
    lengths = [len(r) for r in responses]
    width = max(lengths, default=0)
    if max_length is not None:
        if width > max_length:
            raise DataError(f"pad_responses: a response has {width} tokens, more than max_length={max_length}")
        width = max_length
    ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.long)
    for row, (response, n) in enumerate(zip(responses, lengths)):
        if n:
            ids[row, :n] = torch.tensor(list(response), dtype=torch.long)
            mask[row, :n] = 1
    return ids, mask
