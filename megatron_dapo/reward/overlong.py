"""DAPO overlong reward shaping ("soft overlong punishment")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int],
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-response penalty ``[B]``: ``min(-(L - (max_response_length - buffer_len)) / buffer_len * factor, 0)``.

    0 up to ``max_response_length - buffer_len`` tokens, then linearly down to ``-penalty_factor`` at
    ``max_response_length`` (verl's DAPO reward manager). Computed in float64, returned as ``dtype``.
    """
    if buffer_len <= 0:
        raise ValueError(f"reward.overlong_buffer.len must be > 0, got {buffer_len}")
    if not math.isfinite(penalty_factor):
        raise ValueError(f"reward.overlong_buffer.penalty_factor must be a finite number, got {penalty_factor!r}")
    if max_response_length < buffer_len:
        raise ValueError(
            f"reward.overlong_buffer.len={buffer_len} exceeds data.max_response_length={max_response_length}"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float64).reshape(-1)
    exceed = lengths - (max_response_length - buffer_len)
    penalty = torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
    return penalty.to(dtype)
