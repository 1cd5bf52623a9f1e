"""PPO clipped policy loss with decoupled clip (clip-higher), dual-clip and loss aggregation (verl 0.9.1 semantics).

Shapes: ``[B, T]`` per-token tensors (B responses, T response tokens); ``response_mask[B, T]`` selects the tokens
that count. Everything is a pure function (no process groups).

The loss of a micro-batch is assembled in ``algo/loss.py`` (``dapo_loss``), from the pieces here: the per-token
policy-loss terms (a registered variant: ``vanilla`` is verl's ``compute_policy_loss_vanilla``), :func:`agg_loss`
with explicit global normalisers, and :func:`policy_loss_metric_sums`.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_dapo.algo.masked import masked_sum
from megatron_dapo.algo.registry import register_policy_loss

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to [-20, 20] before exp
SEQ_TOKEN_MEAN_EPS = 1e-8  # verl: per-sequence token mean divides by (count + 1e-8)

Number = int | float | torch.Tensor

__all__ = [
    "LOSS_AGG_MODES",
    "LossAggMode",
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
        token_counts = loss_mask.sum(dim=-1)
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


def compute_policy_loss_terms(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    is_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token PPO terms, all ``[B, T]`` (nothing is masked here; aggregate with :func:`agg_loss`).

    With ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and ``A`` the advantages:
    ``l1 = -A r``, ``l2 = -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``, ``clipped = max(l1, l2)``;
    for ``A < 0`` the dual clip caps the loss at ``-A * clip_ratio_c``: ``min(clipped, -A c)``.

    Returns:
        ``pg_losses``: per-token loss (times ``is_weights`` when given, as verl applies rollout IS weights);
        ``clipped``: float indicator ``l2 > l1`` (for ``pg_clipfrac``);
        ``clipped_lower``: float indicator that the dual clip is active (``A < 0`` and ``clipped > -A c``);
        ``approx_kl``: ``-(clamped log-ratio)`` = ``old_log_prob - log_prob`` clamped (for ``ppo_kl``);
        ``ratio``: ``r``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(neg_approx_kl)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses1 = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    clip_losses2 = torch.minimum(losses3, clip_losses1)
    negative = advantages < 0
    pg_losses = torch.where(negative, clip_losses2, clip_losses1)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    return {
        "pg_losses": pg_losses,
        "clipped": torch.gt(losses2, losses1).to(log_prob.dtype).detach(),
        "clipped_lower": (torch.gt(clip_losses1, losses3) & negative).to(log_prob.dtype).detach(),
        "approx_kl": (-neg_approx_kl).detach(),
        "ratio": ratio,
    }


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    cfg,
    is_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """verl's ``vanilla`` policy loss: :func:`compute_policy_loss_terms` with the actor's clip settings
    (``actor.clip_ratio_low/high``, ``clip_ratio_c``)."""
    return compute_policy_loss_terms(
        log_prob, old_log_prob, advantages, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, is_weights
    )


def policy_loss_metric_sums(terms: dict[str, torch.Tensor], response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked token sums of the metric terms of one micro-batch (detached 0-dim tensors).

    Returns ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` sums and ``num_tokens``. Sum them over micro-batches
    and ranks, then divide each by ``num_tokens + 1e-8`` to get verl's batch metrics (which are masked token means
    whatever the loss aggregation mode).
    """
    return {
        "pg_clipfrac": masked_sum(terms["clipped"], response_mask).detach(),
        "pg_clipfrac_lower": masked_sum(terms["clipped_lower"], response_mask).detach(),
        "ppo_kl": masked_sum(terms["approx_kl"], response_mask).detach(),
        "num_tokens": response_mask.sum().to(terms["approx_kl"].dtype),
    }


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
