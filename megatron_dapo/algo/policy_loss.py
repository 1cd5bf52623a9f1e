"""PPO clipped policy loss with decoupled clip (clip-higher), dual-clip and loss aggregation (verl 0.9.1 semantics).

Shapes: ``[B, T]`` per-token tensors (B responses, T response tokens); ``response_mask[B, T]`` selects the tokens
that count. Everything is a pure function (no process groups).

Two ways to use it:

* whole batch: :func:`compute_policy_loss` returns the aggregated loss and the metrics for the batch it is given;
* split (distributed-exact) form for a loss hook that sees one micro-batch at a time:
  :func:`compute_policy_loss_terms` gives the per-token loss matrix and indicators, :func:`agg_loss` aggregates a
  micro-batch with explicit *global* normalisers (obtained by summing :func:`agg_normalisers` over all
  micro-batches and data-parallel ranks of the optimizer step), and :func:`policy_loss_metric_sums` gives token
  sums for the metrics. Then ``sum over micro-batches and ranks of agg_loss(micro, normalisers=global)`` equals
  ``agg_loss(whole batch)`` for every mode (up to float rounding). If the data-parallel gradient reduction
  *averages* over ranks (Megatron's default), multiply each rank's loss by the DP size to get the sum.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_dapo.algo.masked import masked_sum

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to [-20, 20] before exp
SEQ_TOKEN_MEAN_EPS = 1e-8  # verl: per-sequence token mean divides by (count + 1e-8)

Number = int | float | torch.Tensor

__all__ = [
    "LOSS_AGG_MODES",
    "LossAggMode",
    "agg_loss",
    "agg_normalisers",
    "compute_policy_loss",
    "compute_policy_loss_terms",
    "compute_rollout_is_weights",
    "policy_loss_metric_sums",
]


def _as_divisor(value: Number, like: torch.Tensor) -> torch.Tensor:
    """Normaliser as a tensor of ``like``'s dtype; a zero normaliser becomes 1 (the numerator is then 0 too)."""
    d = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return torch.where(d == 0, torch.ones_like(d), d)


def agg_normalisers(loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Local counts to be summed over micro-batches and DP ranks to get :func:`agg_loss`'s global normalisers.

    Returns ``{"global_token_count": number of masked tokens, "global_seq_count": number of sequences with at
    least one masked token}`` (0-dim float64 tensors) for ``loss_mask[B, T]``.
    """
    mask = loss_mask.to(torch.float64)
    return {
        "global_token_count": mask.sum(),
        "global_seq_count": (mask.sum(dim=-1) > 0).to(torch.float64).sum(),
    }


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

    Passing the global normalisers (sums of :func:`agg_normalisers` over the whole batch) makes the result additive
    over any split of the batch into micro-batches/ranks. Fully masked sequences contribute nothing; a fully masked
    batch gives 0 (verl 0.9.1 gives NaN, 0/0; see ``docs/verl_config_mapping.md``).
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


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    global_token_count: Number | None = None,
    global_seq_count: Number | None = None,
    max_response_length: Number | None = None,
    chunk_elements: int | None = -1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO policy loss of a batch (verl ``compute_policy_loss_vanilla``).

    Args:
        log_prob, old_log_prob, advantages, response_mask: ``[B, T]``.
        clip_ratio_low, clip_ratio_high: decoupled clip range ``[1 - low, 1 + high]`` (DAPO clip-higher).
        clip_ratio_c: dual-clip bound (> 1) for negative advantages.
        loss_agg_mode: see :func:`agg_loss`.
        is_weights: optional ``[B, T]`` (detached) truncated IS weights multiplied into the per-token loss.
        global_token_count, global_seq_count, max_response_length: optional normalisers, see :func:`agg_loss`;
            by default those of this batch (``max_response_length`` defaults to ``T``).
        chunk_elements: process the batch in blocks of rows of at most this many elements, summing the blocks
            with the batch's normalisers (the split form, so the result is the same up to float summation order).
            This keeps the temporaries cache- and allocator-friendly on CPU (>10x faster for 512 x 4096 there).
            ``-1`` (default): 65536 for CPU tensors, one block otherwise; ``None``: one block.

    Returns:
        ``(loss, metrics)``: ``loss`` is a differentiable 0-dim tensor; ``metrics`` maps ``pg_loss`` (the loss,
        detached), ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` to detached 0-dim tensors (call ``.item()``
        when logging). The last three are masked token means over this batch (``sum / (count + 1e-8)``, verl).
    """
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
    batch, width = log_prob.shape
    if chunk_elements == -1:
        chunk_elements = 65536 if log_prob.device.type == "cpu" else None
    rows = batch if not chunk_elements else max(1, chunk_elements // max(1, width))
    counts = agg_normalisers(response_mask)
    norm = {
        "global_token_count": counts["global_token_count"] if global_token_count is None else global_token_count,
        "global_seq_count": counts["global_seq_count"] if global_seq_count is None else global_seq_count,
        "max_response_length": width if max_response_length is None else max_response_length,
    }
    loss = log_prob.new_zeros(())
    sums = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}
    for start in range(0, batch, rows):
        block = slice(start, start + rows)
        terms = compute_policy_loss_terms(
            log_prob[block],
            old_log_prob[block],
            advantages[block],
            clip_ratio_low,
            clip_ratio_high,
            clip_ratio_c,
            None if is_weights is None else is_weights[block],
        )
        loss = loss + agg_loss(terms["pg_losses"], response_mask[block], loss_agg_mode, **norm)
        block_sums = policy_loss_metric_sums(terms, response_mask[block])
        for key in sums:
            sums[key] = sums[key] + block_sums[key]
    denom = counts["global_token_count"].to(log_prob.dtype) + 1e-8
    metrics = {"pg_loss": loss.detach()}
    metrics.update({key: torch.as_tensor(value, dtype=log_prob.dtype) / denom for key, value in sums.items()})
    return loss, metrics


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
