"""The DAPO loss of one micro-batch: the single function the actor's loss hook, the tests' whole-batch reference and
``benchmarks/algo.py`` all call.

Exact under any split of an optimizer step's mini-batch into micro-batches and data-parallel ranks: every micro-batch
is aggregated with the *global* normalisers of the mini-batch (``LossNormalisers``: the caller sums
``local_loss_counts`` over micro-batches and ranks), so the per-micro-batch losses add up to the whole-batch loss
for every ``loss_agg_mode``. Metrics come back as sums (``LOSS_METRIC_SUMS``) that the caller adds over
micro-batches and ranks before ``loss_metrics`` turns them into verl's ``actor/*`` values. Pure: no process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dapo.algo.kl import kl_penalty
from megatron_dapo.algo.loss_aggregation import (
    ROW_MEAN,
    PolicyLossInputs,
    agg_loss,
    compute_rollout_is_weights,
    policy_loss_metric_sums,
)
from megatron_dapo.algo.masked import masked_sum
from megatron_dapo.algo.registry import POLICY_LOSSES
from megatron_dapo.config import ActorConfig

__all__ = [
    "LOSS_METRIC_SUMS",
    "LossNormalisers",
    "RowSum",
    "dapo_loss",
    "local_loss_counts",
    "loss_metrics",
    "partial_row_sum",
]

#: The metric sums ``dapo_loss`` returns, in a fixed order (the caller reduces them as one tensor).
LOSS_METRIC_SUMS: tuple[str, ...] = (
    "pg_loss",
    "entropy",
    "kl_loss",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "num_tokens",
    "logprob_diff_sum",
    "logprob_diff_count",
)


@dataclass(frozen=True)
class LossNormalisers:
    """An optimizer step's normalisers: loss tokens and sequences with at least one loss token, over every
    micro-batch and data-parallel rank, the response budget (``seq-mean-token-sum-norm``'s constant) and every
    sequence, fully masked ones included (``row_count``: the divisor of losses averaged over rows, ``ROW_MEAN``,
    such as verl's GMPO; None = ``seq_count``)."""

    token_count: float
    seq_count: float
    max_response_length: int
    row_count: Optional[float] = None

    @classmethod
    def of(cls, loss_mask: torch.Tensor, max_response_length: Optional[int] = None) -> LossNormalisers:
        """The normalisers of a whole batch held in one place (no split)."""
        tokens, seqs, rows = local_loss_counts(loss_mask).tolist()
        width = loss_mask.shape[-1] if max_response_length is None else max_response_length
        return cls(tokens, seqs, int(width), rows)


def local_loss_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64: this part's loss tokens, sequences with at least one, and sequences — summed over parts,
    the ``LossNormalisers`` counts."""
    mask = loss_mask.to(torch.float64)
    rows = torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    return torch.stack([mask.sum(), (mask.sum(-1) > 0).to(torch.float64).sum(), rows])


RowSum = Callable[[torch.Tensor], torch.Tensor]


def partial_row_sum(mask: torch.Tensor, reduce: Callable[[torch.Tensor], object]) -> RowSum:
    """``row_sum`` for sequences split over ranks (context parallelism): this rank's masked row sums, completed by
    ``reduce(t)``, an in-place sum of ``t`` over the ranks holding the other parts (the caller's all-reduce: this
    module stays free of process groups). The value is the whole sequence's; the gradient flows through this rank's
    tokens only (each rank back-propagates its own tokens, as for the per-token losses)."""

    def row_sum(values: torch.Tensor) -> torch.Tensor:
        local = masked_sum(values, mask, axis=-1)
        total = local.detach().clone()
        reduce(total)
        return total + (local - local.detach())  # exactly ``total`` in value

    return row_sum


def _aggregator(default_mode: str, norm: LossNormalisers, mask: torch.Tensor, row_sum: Optional[RowSum]):
    """``agg(values, mode=default_mode, values_mask=mask)``: ``agg_loss`` with the step's global normalisers (and
    ``ROW_MEAN`` over ``norm.row_count``); under CP, ``seq-mean-token-mean`` divides each sequence by its whole
    count of ``values_mask`` tokens (``row_sum``), one all-reduce per mask however many terms use it."""
    row_counts: dict[int, torch.Tensor] = {}

    def agg(values: torch.Tensor, mode: str = default_mode, values_mask: torch.Tensor = mask) -> torch.Tensor:
        seqs = norm.seq_count
        if mode == ROW_MEAN:  # sequence losses spread over their tokens, averaged over every row
            mode, seqs = "seq-mean-token-sum", norm.seq_count if norm.row_count is None else norm.row_count
        if mode == "seq-mean-token-mean" and row_sum is not None and id(values_mask) not in row_counts:
            # the per-sequence token mean divides by the whole sequence's count, not this CP rank's share
            row_counts[id(values_mask)] = row_sum((values_mask != 0).to(values.dtype)).detach()
        return agg_loss(
            values,
            values_mask,
            mode,
            global_token_count=norm.token_count,
            global_seq_count=seqs,
            max_response_length=norm.max_response_length,
            row_token_counts=row_counts.get(id(values_mask)),
        )

    return agg


def dapo_loss(
    log_probs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    *,
    loss_mask: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    cfg: ActorConfig,
    norm: LossNormalisers,
    old_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    rollout_is_threshold: Optional[float] = None,
    row_sum: Optional[RowSum] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metric sums. All per-token tensors are ``[b, T]``.

    ``loss = agg(policy loss) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(KL(pi || ref))`` with ``agg`` =
    ``agg_loss(·, loss_mask, cfg.loss_agg_mode, norm)`` and the policy loss ``cfg.policy_loss.loss_mode`` from the
    registry (``algo/policy_losses.py``).

    ``old_log_probs=None`` is the on-policy path (one epoch, one mini-batch: the policy has not moved since the
    rollout): the old policy is this forward's own log-probs, detached; the truncated-IS weights
    (``rollout_is_threshold``) and the train-vs-rollout mismatch sums (``logprob_diff_*``) then come from them.
    ``entropy`` may be None when ``entropy_coeff == 0`` (the entropy metric is then 0).

    ``row_sum(x[b, T]) -> [b]`` sums a per-token tensor over each sequence's loss tokens, for the sequence-level
    policy losses (GSPO, GMPO) and the per-sequence token counts of ``seq-mean-token-mean``: None = the local masked
    row sum, right whenever the micro-batch holds whole sequences (packed/THD micro-batches too: the loss still sees
    one row per sequence); the actor's hook passes one that adds the partial sums of the context-parallel ranks
    (:func:`partial_row_sum`). A policy loss may impose its own aggregation (``terms["loss_agg_mode"]``: SAPO's
    ``seq-mean-token-mean``, GMPO's ``ROW_MEAN`` over ``norm.row_count``); the entropy and KL terms keep
    ``cfg.loss_agg_mode``. A loss may also narrow the tokens its own terms count (``terms["loss_mask"]``:
    ``bypass_mode``'s rejection sampling): the policy loss and its metric means use it, the normalisers do not
    (``seq-mean-token-mean`` divides each sequence by its kept tokens, as verl's ``agg_loss`` on the rejection mask).
    ``rollout_log_probs`` reach the loss as ``PolicyLossInputs.rollout_log_prob`` (``bypass_mode``'s old policy).
    """
    on_policy = old_log_probs is None
    old = log_probs.detach() if on_policy else old_log_probs
    if on_policy and rollout_is_threshold and rollout_log_probs is not None:
        rollout_is_weights = compute_rollout_is_weights(old, rollout_log_probs, response_mask, rollout_is_threshold)
    mask = loss_mask.to(log_probs.dtype)

    agg = _aggregator(cfg.loss_agg_mode, norm, mask, row_sum)

    inputs = PolicyLossInputs(log_probs, old, advantages, mask, cfg, rollout_is_weights, row_sum, rollout_log_probs)
    terms = POLICY_LOSSES.get(cfg.policy_loss.loss_mode)(inputs)
    # a loss that rejects tokens (bypass_mode's rejection sampling) returns the tokens that keep their loss; the
    # normalisers stay the loss mask's (``norm``), so a rejected token counts in them with a zero loss
    pg_mask = terms.get("loss_mask", mask)
    pg_loss = agg(terms["pg_losses"], terms.get("loss_agg_mode", cfg.loss_agg_mode), pg_mask)
    loss = pg_loss
    sums = {"pg_loss": pg_loss.detach(), **policy_loss_metric_sums(terms, pg_mask)}
    if entropy is not None:
        entropy_loss = agg(entropy)
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * entropy_loss
        sums["entropy"] = entropy_loss.detach()
    if cfg.use_kl_loss:
        kl = agg(kl_penalty(log_probs, ref_log_probs, cfg.kl_loss_type))
        loss = loss + cfg.kl_loss_coef * kl
        sums["kl_loss"] = kl.detach()
    if on_policy and rollout_log_probs is not None:  # train-vs-rollout mismatch, from this forward
        diff = (old.double() - rollout_log_probs.double()).abs()[response_mask.bool()]
        sums["logprob_diff_sum"] = diff.sum()
        sums["logprob_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
        sums["logprob_diff_count"] = torch.tensor(float(diff.numel()), dtype=torch.float64)
    return loss, sums


def loss_metrics(sums: dict[str, float], use_kl_loss: bool, logprob_diff_max: float = 0.0) -> dict[str, float]:
    """verl's ``actor/*`` metrics (and ``rollout/logprob_diff_*`` on the on-policy path) from the metric sums of
    every micro-batch and rank: losses are sums already (global normalisers); the fractions are masked token means."""
    tokens = sums.get("num_tokens", 0.0) + 1e-8
    out = {
        "actor/pg_loss": sums.get("pg_loss", 0.0),
        "actor/entropy": sums.get("entropy", 0.0),
        "actor/pg_clipfrac": sums.get("pg_clipfrac", 0.0) / tokens,
        "actor/pg_clipfrac_lower": sums.get("pg_clipfrac_lower", 0.0) / tokens,
        "actor/ppo_kl": sums.get("ppo_kl", 0.0) / tokens,
    }
    if use_kl_loss:
        out["actor/kl_loss"] = sums.get("kl_loss", 0.0)
    if sums.get("logprob_diff_count", 0.0) > 0:
        out["rollout/logprob_diff_mean"] = sums["logprob_diff_sum"] / sums["logprob_diff_count"]
        out["rollout/logprob_diff_max"] = float(logprob_diff_max)
    return out
