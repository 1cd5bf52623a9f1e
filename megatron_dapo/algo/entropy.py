"""Entropy of categorical distributions given by logits (verl ``entropy_from_logits``).

Pure functions. For tensor-parallel (vocab-sharded) logits use the lead's vocab-parallel code; these functions
need the full vocabulary on the last dimension.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.masked import masked_mean
from megatron_dapo.algo.policy_loss import agg_loss

__all__ = ["compute_entropy_loss", "entropy_from_logits", "masked_entropy_mean"]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    # H = logsumexp(z) - sum(softmax(z) * z); stable for large |z| and -inf entries (softmax 0 times -inf -> nan
    # is avoided by zeroing those products).
    probs = torch.softmax(logits, dim=-1)
    prod = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - prod.sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last dimension: ``[..., V] -> [...]``.

    Computed as ``logsumexp(z) - sum(softmax(z) * z)``, in the dtype of ``logits`` (pass fp32 logits for fp32
    accuracy). ``chunk_size`` processes that many rows (of the flattened leading dimensions) at a time to bound the
    temporary memory; the result is identical. Differentiable.
    """
    if chunk_size is None or logits.dim() < 2:
        return _entropy(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    parts = [_entropy(flat[i : i + chunk_size]) for i in range(0, flat.shape[0], chunk_size)]
    out = torch.cat(parts) if parts else flat.new_zeros(0)
    return out.reshape(logits.shape[:-1])


def masked_entropy_mean(logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean entropy over the masked tokens: ``logits[B, T, V]``, ``response_mask[B, T]`` -> 0-dim."""
    return masked_mean(entropy_from_logits(logits), response_mask)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **normalisers: object
) -> torch.Tensor:
    """Entropy aggregated like the policy loss (verl ``compute_entropy_loss``); ``normalisers`` go to ``agg_loss``."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **normalisers)  # type: ignore[arg-type]
