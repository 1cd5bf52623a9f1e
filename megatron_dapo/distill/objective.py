"""A micro-batch's distillation loss and metrics, and how it joins the task loss (verl 0.9.1's
``distillation_loss`` and ``distillation_ppo_loss``, ``verl/trainer/distillation/losses.py``). Pure: the caller
passes the step's global normalisers and reduces the metrics over micro-batches and ranks (``METRIC_REDUCTIONS``).

Two uses of the per-token loss ``d`` (``losses.py``), after ``loss_max_clamp`` (``d`` clamped to ``[-c, c]``):

* ``use_policy_gradient``: ``-d`` (detached) is the advantage of the policy loss ``policy_loss_mode`` (verl: vanilla
  PPO with the section's clip ratios and the dual-clip bound 3), on the student's log-probs of the sampled tokens
  against ``old_log_probs`` — the per-token reverse KL as a dense reward (use ``k1``).
* otherwise ``d`` is aggregated (``actor.loss_agg_mode``) and back-propagated directly (use ``k3`` or
  ``forward_kl_topk``).

``combine_with_task_loss``: ``task + coef * distill`` with ``use_task_rewards``, else ``distill`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dapo.algo.loss_aggregation import PolicyLossInputs, agg_loss  # (registers the built-in policy losses)
from megatron_dapo.algo.masked import masked_mean
from megatron_dapo.algo.registry import POLICY_LOSSES
from megatron_dapo.distill.losses import DistillationInputs, Terms, get_distillation_loss, loss_settings

CLIP_RATIO_C = 3.0  # verl's distillation loss config has no clip_ratio_c: its vanilla loss falls back to 3.0

#: How each metric of one micro-batch combines with the others' (verl's ``AggregationType``); the rest: "mean".
METRIC_REDUCTIONS: dict[str, str] = {
    "distillation/loss_min": "min",
    "distillation/loss_max": "max",
    "distillation/student_mass_min": "min",
    "distillation/student_mass_max": "max",
    "distillation/teacher_mass_min": "min",
    "distillation/teacher_mass_max": "max",
    "distillation/loss": "sum",
}

__all__ = ["CLIP_RATIO_C", "METRIC_REDUCTIONS", "Normalisers", "combine_with_task_loss", "distillation_loss"]


@dataclass(frozen=True)
class Normalisers:
    """The optimizer step's loss tokens and sequences (over every micro-batch and rank; None = this micro-batch's)
    and ``seq-mean-token-sum-norm``'s constant (None = the mask's width), as ``algo/loss_aggregation.agg_loss``."""

    token_count: Optional[float] = None
    seq_count: Optional[float] = None
    max_response_length: Optional[int] = None


@dataclass(frozen=True)
class _PolicyCfg:
    """The attributes a registered policy loss reads, from the distillation loss section."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float = CLIP_RATIO_C


def _plain_mean(values: torch.Tensor) -> torch.Tensor:
    return values.float().mean() if values.numel() else values.new_zeros((), dtype=torch.float32)


def _extreme(values: torch.Tensor, kind: str) -> torch.Tensor:
    if not values.numel():  # verl fails on an empty selection; a fully masked micro-batch reports 0
        return values.new_zeros((), dtype=torch.float32)
    return (values.min() if kind == "min" else values.max()).float()


def _term_metrics(terms: Terms, mask: torch.Tensor, topk: Optional[int]) -> dict[str, torch.Tensor]:
    """verl's per-micro-batch metrics of the loss terms, over the response tokens (plain means, as verl)."""
    keep = mask.bool()
    losses = terms["losses"].detach()[keep]
    out = {"distillation/loss_min": _extreme(losses, "min"), "distillation/loss_max": _extreme(losses, "max")}
    if "abs_loss" in terms:
        out["distillation/abs_loss"] = _plain_mean(terms["abs_loss"][keep])
    for side in ("student", "teacher"):
        if f"{side}_mass" in terms:
            mass = terms[f"{side}_mass"].detach()[keep]
            out[f"distillation/{side}_mass"] = _plain_mean(mass)
            out[f"distillation/{side}_mass_min"] = _extreme(mass, "min")
            out[f"distillation/{side}_mass_max"] = _extreme(mass, "max")
    if "overlap_count" in terms and topk:
        count = terms["overlap_count"]
        out["distillation/overlap_ratio"] = _plain_mean(count[keep]) / topk
        out["distillation/overlap_token_advantage"] = _plain_mean(terms["overlap_token_advantage"][keep & (count > 0)])
    return out


def _policy_gradient(
    inputs: DistillationInputs,
    losses: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    is_weights: Optional[torch.Tensor],
    agg: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss as a negative advantage of the policy loss ``policy_loss_mode``."""
    cfg = inputs.cfg
    if inputs.student_log_probs is None or old_log_probs is None:
        raise ValueError("distillation use_policy_gradient needs student_log_probs and old_log_probs, got None")
    low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    mask = inputs.response_mask
    policy_inputs = PolicyLossInputs(
        log_prob=inputs.student_log_probs,
        old_log_prob=old_log_probs,
        advantages=-losses.detach(),
        response_mask=mask,
        cfg=_PolicyCfg(low, high),
        is_weights=is_weights,
    )
    terms = POLICY_LOSSES.get(cfg.policy_loss_mode)(policy_inputs)
    metrics = {
        f"distillation/{name}": masked_mean(terms[term].detach(), mask)
        for name, term in (("pg_clipfrac", "clipped"), ("ppo_kl", "approx_kl"), ("pg_clipfrac_lower", "clipped_lower"))
        if term in terms
    }
    return agg(terms["pg_losses"]), metrics


def distillation_loss(
    inputs: DistillationInputs,
    loss_agg_mode: str,
    norm: Normalisers = Normalisers(),
    old_log_probs: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's distillation loss (0-dim, differentiable w.r.t. the student's log-probs or logits) and its
    metrics (detached 0-dim tensors, verl's names; ``distillation/loss`` is the loss itself).

    ``old_log_probs``/``is_weights`` (``[B, T]``): the policy-gradient path's old policy and rollout IS weights.
    """
    cfg = inputs.cfg
    terms = get_distillation_loss(cfg.loss_mode)(inputs)
    metrics = _term_metrics(terms, inputs.response_mask, cfg.topk if loss_settings(cfg.loss_mode).use_topk else None)
    losses = terms["losses"]
    if cfg.loss_max_clamp is not None:  # both sides: k1 can be negative
        losses = losses.clamp(min=-cfg.loss_max_clamp, max=cfg.loss_max_clamp)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return agg_loss(
            values, inputs.response_mask.to(values.dtype), loss_agg_mode, norm.token_count, norm.seq_count,
            norm.max_response_length,
        )  # fmt: skip

    if cfg.use_policy_gradient:
        loss, pg_metrics = _policy_gradient(inputs, losses, old_log_probs, is_weights, agg)
        metrics.update(pg_metrics)
    else:
        loss = agg(losses)
    metrics["distillation/loss"] = loss.detach()
    return loss, metrics


def combine_with_task_loss(task_loss: torch.Tensor | float, distill_loss: torch.Tensor, cfg: Any) -> torch.Tensor:
    """verl's ``distillation_ppo_loss``: ``task_loss + distillation_loss_coef * distill_loss`` with
    ``use_task_rewards``; without, the distillation loss alone (coefficient 1, the task loss dropped)."""
    if cfg.use_task_rewards:
        return task_loss + cfg.distillation_loss_coef * distill_loss
    return distill_loss
