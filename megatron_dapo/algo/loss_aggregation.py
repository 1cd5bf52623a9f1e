"""Loss aggregation, policy-loss metric sums and truncated IS weights (verl 0.9.1 semantics).

Shapes: ``[B, T]`` per-token tensors (B responses, T response tokens); ``response_mask[B, T]`` selects the tokens
that count. Everything is a pure function (no process groups).

The loss of a micro-batch is assembled in ``algo/loss.py`` (``dapo_loss``), from the pieces here: the per-token
policy-loss terms of a registered variant (``algo/policy_losses.py``, verl's twelve names; ``vanilla`` is verl's
``compute_policy_loss_vanilla``, re-exported here with :class:`PolicyLossInputs`), :func:`agg_loss` with explicit
global normalisers, and :func:`policy_loss_metric_sums`.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_dapo.algo.masked import masked_sum
from megatron_dapo.algo.policy_losses import (  # importing this module registers every built-in policy loss
    LOG_RATIO_CLAMP,
    ROW_MEAN,
    PolicyLossInputs,
    compute_policy_loss_terms,
    vanilla_policy_loss,
)

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEQ_TOKEN_MEAN_EPS = 1e-8  # verl: per-sequence token mean divides by (count + 1e-8)

Number = int | float | torch.Tensor
#: verl's metric (``actor/<name>``, a masked token mean) and the per-token term of a policy loss it averages.
METRIC_TERMS: dict[str, str] = {"pg_clipfrac": "clipped", "pg_clipfrac_lower": "clipped_lower", "ppo_kl": "approx_kl"}

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "LossAggMode",
    "METRIC_TERMS",
    "PolicyLossInputs",
    "ROW_MEAN",
    "agg_loss",
    "compute_policy_loss_terms",
    "compute_rollout_is_weights",
    "policy_loss_metric_sums",
    "vanilla_policy_loss",
]


def _as_divisor(value: Number, like: torch.Tensor) -> torch.Tensor:
    """Normaliser as a tensor of ``like``'s dtype; a zero normaliser becomes 1 (the numerator is then 0 too)."""
    d = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return torch.where(d == 0, torch.ones_like(d), d)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_token_count: Number | None = None,
    global_seq_count: Number | None = None,
    max_response_length: Number | None = None,
    row_token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a ``[B, T]`` loss matrix into a scalar.

    Modes (``m`` = mask, ``N`` = normaliser):

    * ``token-mean``: ``sum(loss * m) / N_tokens``; ``N_tokens = global_token_count`` or ``m.sum()``.
    * ``seq-mean-token-sum``: per sequence ``sum_t(loss * m)``, summed over sequences with at least one token and
      divided by ``N_seqs = global_seq_count`` or the local number of such sequences.
    * ``seq-mean-token-mean``: per sequence ``sum_t(loss * m) / (count + 1e-8)``, then as above.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): as ``seq-mean-token-sum``, then divided by the constant
      ``C = max_response_length`` (verl's ``loss_scale_factor``), defaulting to ``T = loss_mask.shape[-1]`` as verl
      does: ``sum(loss * m) / N_seqs / C``. Pass ``max_response_length`` whenever micro-batches may be padded to
      different ``T`` so that the split form stays exact.

    ``row_token_counts[B]``: each sequence's loss tokens, ``seq-mean-token-mean``'s per-sequence divisor, when the
    rows hold only part of their sequences (context parallelism: the counts summed over the CP ranks); default
    ``loss_mask.sum(-1)``.

    Passing the global normalisers (``algo/loss.py``: ``LossNormalisers``, summed over the whole batch) makes the
    result additive over any split of the batch into micro-batches/ranks. Fully masked sequences contribute
    nothing; a fully masked batch gives 0 (verl 0.9.1 gives NaN, 0/0; see ``docs/verl_config_mapping.md``).
    Values outside the mask never contaminate the result (NaN-safe).

    Returns a 0-dim tensor of ``loss_mat``'s dtype, differentiable w.r.t. ``loss_mat``.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    if loss_agg_mode == "token-mean":
        n = loss_mask.sum() if global_token_count is None else global_token_count
        return masked_sum(loss_mat, loss_mask) / _as_divisor(n, loss_mat)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        token_counts = loss_mask.sum(dim=-1) if row_token_counts is None else row_token_counts.to(loss_mat.dtype)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (token_counts + SEQ_TOKEN_MEAN_EPS)
        seq_mask = token_counts > 0
        n = seq_mask.sum() if global_seq_count is None else global_seq_count
        loss = masked_sum(seq_losses, seq_mask) / _as_divisor(n, loss_mat)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            c = loss_mask.shape[-1] if max_response_length is None else max_response_length
            loss = loss / _as_divisor(c, loss_mat)
        return loss
    raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")


def policy_loss_metric_sums(terms: dict[str, torch.Tensor], response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked token sums of the metric terms of one micro-batch (detached 0-dim tensors).

    Returns ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` sums (for the terms ``clipped``, ``clipped_lower``,
    ``approx_kl`` the loss returned; a loss verl reports no such metric for leaves the term out) and ``num_tokens``.
    Sum them over micro-batches and ranks, then divide each by ``num_tokens + 1e-8`` to get verl's batch metrics
    (which are masked token means whatever the loss aggregation mode).
    """
    dtype = terms["pg_losses"].dtype
    sums = {
        metric: masked_sum(terms[term], response_mask).detach()
        for metric, term in METRIC_TERMS.items()
        if term in terms
    }
    sums["num_tokens"] = response_mask.sum().to(dtype)
    return sums


@torch.no_grad()
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Token-level truncated importance-sampling weights ``min(pi_old / pi_rollout, threshold)`` (verl TIS).

    ``exp(clamp(old_log_prob - rollout_log_prob, -20, 20)) * mask``, truncated above at ``threshold``, detached.
    All tensors ``[B, T]``; returns ``[B, T]`` (0 outside the mask).
    """
    if threshold <= 0:
        raise ValueError(f"rollout IS threshold must be positive, got {threshold}")
    log_ratio = torch.clamp(old_log_prob - rollout_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    weights = torch.exp(log_ratio) * response_mask.to(old_log_prob.dtype)
    return weights.clamp(max=threshold).detach()
