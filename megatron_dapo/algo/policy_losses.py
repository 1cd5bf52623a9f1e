"""The registered policy losses: verl 0.9.1's ``core_algos`` policy losses under verl's names, as pure functions.

Each entry takes one :class:`PolicyLossInputs` and returns the *unaggregated* per-token terms (``[B, T]``):

* ``pg_losses`` (required): the per-token loss, aggregated by ``dapo_loss`` with ``agg_loss`` and the step's global
  normalisers (``algo/loss.py``), so the loss is exact under any micro-batch/data-parallel split;
* ``clipped``, ``clipped_lower``, ``approx_kl`` (optional, detached): the terms whose masked token means are verl's
  ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` for that loss (a term verl does not report
  is left out, and its metric then reads 0);
* ``loss_agg_mode`` (optional ``str``): an aggregation the loss imposes whatever ``actor.loss_agg_mode`` says (verl's
  SAPO always uses ``seq-mean-token-mean``; GMPO averages sequence losses over every row: :data:`ROW_MEAN`);
* ``loss_mask`` (optional, detached ``[B, T]``): the tokens whose loss counts when the loss rejects some
  (``bypass_mode``'s rejection sampling): ``dapo_loss`` aggregates ``pg_losses`` and takes the metric means over
  it, while the global normalisers (token and sequence counts, summed before the forward) stay those of the loss
  mask, so a rejected token still counts in ``token-mean``'s denominator with a zero loss, as in verl's
  ``global_batch_info`` path.

Sequence-level quantities (GSPO's length-normalised log-ratio, GMPO's geometric mean) go through
``inputs.row_sum``, which sums a per-token tensor over each sequence's loss tokens: locally by default, and over
the context-parallel ranks holding parts of the sequence in the actor's loss hook (``actor/actor.py``). Packed
(THD) micro-batches still hand the loss one row per sequence (``[b, T]``, ``batch.pack_micro_batch``), so the local
row sum is the whole sequence's there. Nothing here talks to a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dapo.algo.masked import masked_mean, masked_sum
from megatron_dapo.algo.registry import register_policy_loss
from megatron_dapo.algo.rollout_correction import rejection_keep_mask, rollout_is_weights

LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl's GSPO clamps the combined sequence log-ratio above at 10
GEO_MEAN_EPS = 1e-8  # verl's GMPO divides sequence sums by (token count + 1e-8)
GEO_MEAN_IS_EPS = 1e-10  # verl's GMPO takes log(rollout IS weight + 1e-10)
BINARY_KL_EPS = 1e-8  # verl's DPPO-KL: log((1 - p_old + 1e-8) / (1 - p + 1e-8))
#: ``loss_agg_mode`` value a loss returns to be averaged over rows: the sum of its per-token losses divided by the
#: step's number of sequences, fully masked ones included (verl's ``torch.mean`` over GMPO's sequence losses).
ROW_MEAN = "row-mean"

__all__ = [
    "LOG_RATIO_CLAMP",
    "ROW_MEAN",
    "PolicyLossInputs",
    "compute_policy_loss_terms",
]

Terms = dict[str, Any]


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a registered policy loss gets: ``[B, T]`` tensors of one micro-batch (this context-parallel rank's
    tokens of each sequence under CP), the actor config and the per-sequence sum.

    ``response_mask`` is the loss mask (tokens that count). ``row_sum(x) -> [B]`` sums ``x`` over each sequence's
    loss tokens, over every rank that holds part of the sequence, with gradients flowing through this rank's own
    tokens; default: the local masked row sum (the whole sequence when it is not split). ``rollout_log_prob``: the
    rollout engine's log-probs of the sampled tokens (None when the batch has none); ``bypass_mode`` needs them.
    """

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    cfg: Any  # config.ActorConfig (algo/ sits below the config package, so only loss.py imports it)
    is_weights: Optional[torch.Tensor] = None
    row_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    rollout_log_prob: Optional[torch.Tensor] = None

    def sum_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B]``: ``values`` summed over each sequence's loss tokens (``row_sum``, or the local masked sum)."""
        if self.row_sum is not None:
            return self.row_sum(values)
        return masked_sum(values, self.response_mask, axis=-1)


def _clamped_log_ratio(inputs: PolicyLossInputs) -> torch.Tensor:
    return torch.clamp(inputs.log_prob - inputs.old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _with_is_weights(pg_losses: torch.Tensor, is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    return pg_losses if is_weights is None else pg_losses * is_weights


def _indicator(condition: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return condition.to(like.dtype).detach()


# ------------------------------------------------------------------------------------------------ vanilla (PPO)
def compute_policy_loss_terms(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    is_weights: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Per-token PPO terms, all ``[B, T]`` (nothing is masked here; aggregate with ``agg_loss``).

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
    return {
        "pg_losses": _with_is_weights(pg_losses, is_weights),
        "clipped": _indicator(torch.gt(losses2, losses1), log_prob),
        "clipped_lower": _indicator(torch.gt(clip_losses1, losses3) & negative, log_prob),
        "approx_kl": (-neg_approx_kl).detach(),
        "ratio": ratio,
    }


@register_policy_loss("vanilla")
def vanilla_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``vanilla``: dual-clip PPO (:func:`compute_policy_loss_terms`) with ``actor.clip_ratio_low/high``
    and ``actor.clip_ratio_c``."""
    cfg = inputs.cfg
    return compute_policy_loss_terms(
        inputs.log_prob,
        inputs.old_log_prob,
        inputs.advantages,
        cfg.clip_ratio_low,
        cfg.clip_ratio_high,
        cfg.clip_ratio_c,
        inputs.is_weights,
    )


# ------------------------------------------------------------------------------------------------ token-level
@register_policy_loss("gpg")
def gpg_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``gpg`` (Group Policy Gradient): ``-log_prob * A``. verl reports no metric for it."""
    return {"pg_losses": _with_is_weights(-inputs.log_prob * inputs.advantages, inputs.is_weights)}


@register_policy_loss("dro")
def dro_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``dro`` (Direct Reward Optimisation): ``-(log_prob * A - beta/2 * (log_prob - old)^2)`` with
    ``beta = actor.policy_loss.dro_beta`` (required, > 0). ``ppo_kl`` is the unclamped ``old - log_prob``."""
    beta = inputs.cfg.policy_loss.dro_beta
    if beta is None or beta <= 0:  # config validation says so first; a direct caller still gets verl's error
        raise ValueError("actor.policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = inputs.log_prob - inputs.old_log_prob
    pg_losses = -(inputs.log_prob * inputs.advantages - 0.5 * beta * log_ratio.square())
    return {"pg_losses": _with_is_weights(pg_losses, inputs.is_weights), "approx_kl": (-log_ratio).detach()}


@register_policy_loss("cispo")
def cispo_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``cispo``: ``-sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_prob`` (the gradient
    flows through ``log_prob`` only); ``pg_clipfrac`` counts tokens whose ratio was clipped."""
    cfg = inputs.cfg
    neg_approx_kl = _clamped_log_ratio(inputs)
    ratio = torch.exp(neg_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * inputs.advantages * inputs.log_prob
    return {
        "pg_losses": _with_is_weights(pg_losses, inputs.is_weights),
        "clipped": _indicator(ratio != clipped_ratio, ratio),
        "clipped_lower": torch.zeros_like(ratio),
        "approx_kl": (-neg_approx_kl).detach(),
    }


@register_policy_loss("sapo")
def sapo_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``sapo`` (soft adaptive gate): ``-sigmoid(tau (r - 1)) * 4 / tau * A`` with ``tau = actor.tau_pos``
    where ``A > 0`` and ``actor.tau_neg`` elsewhere; always aggregated ``seq-mean-token-mean``, as verl does
    whatever ``actor.loss_agg_mode`` says. verl reports its clip fractions as 0."""
    adv = inputs.advantages
    neg_approx_kl = _clamped_log_ratio(inputs)
    ratio = torch.exp(neg_approx_kl)
    tau_pos = torch.as_tensor(inputs.cfg.tau_pos, dtype=adv.dtype, device=adv.device)
    tau_neg = torch.as_tensor(inputs.cfg.tau_neg, dtype=adv.dtype, device=adv.device)
    taus = torch.where(adv > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    zeros = torch.zeros_like(ratio)
    return {
        "pg_losses": _with_is_weights(-gates * adv, inputs.is_weights),
        "clipped": zeros,
        "clipped_lower": zeros,
        "approx_kl": (-neg_approx_kl).detach(),
        "loss_agg_mode": "seq-mean-token-mean",
    }


def _dppo_terms(inputs: PolicyLossInputs, valid: torch.Tensor, neg_approx_kl: torch.Tensor) -> Terms:
    """DPPO's shared tail: ``-A * sg(min(r, clip_ratio_c)) * log_prob`` on the tokens inside the trust region
    (``valid``), the truncated ratio acting as truncated IS instead of a dual clip."""
    ratio = torch.exp(neg_approx_kl)
    clip_c = inputs.cfg.clip_ratio_c
    truncated = torch.clamp(ratio, max=clip_c).detach()
    valid = valid.detach().to(ratio.dtype)
    pg_losses = -inputs.advantages * truncated * inputs.log_prob * valid
    return {
        "pg_losses": _with_is_weights(pg_losses, inputs.is_weights),
        "clipped": (1.0 - valid).detach(),
        "clipped_lower": (_indicator(ratio > clip_c, ratio) * valid).detach(),
        "approx_kl": (-neg_approx_kl).detach(),
    }


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``dppo_tv`` (DPPO, binary total variation): a token counts when ``p - p_old <= clip_ratio_high``
    (``A > 0``) or ``p - p_old >= -clip_ratio_low`` (otherwise); the clip ratios are TV thresholds here."""
    cfg = inputs.cfg
    diff = torch.exp(inputs.log_prob) - torch.exp(inputs.old_log_prob)
    valid = torch.where(inputs.advantages > 0, diff <= cfg.clip_ratio_high, diff >= -cfg.clip_ratio_low)
    return _dppo_terms(inputs, valid, _clamped_log_ratio(inputs))


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``dppo_kl`` (DPPO, binary KL): a token counts when the Bernoulli KL between ``p_old`` and ``p`` is
    within ``clip_ratio_high`` (``A > 0``; always when ``p <= p_old``) or ``clip_ratio_low`` (otherwise; always when
    ``p >= p_old``)."""
    cfg = inputs.cfg
    prob, old_prob = torch.exp(inputs.log_prob), torch.exp(inputs.old_log_prob)
    binary_kl = old_prob * (inputs.old_log_prob - inputs.log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS)
    )
    valid_pos = (binary_kl <= cfg.clip_ratio_high) | (prob <= old_prob)
    valid_neg = (binary_kl <= cfg.clip_ratio_low) | (prob >= old_prob)
    valid = torch.where(inputs.advantages > 0, valid_pos, valid_neg)
    return _dppo_terms(inputs, valid, _clamped_log_ratio(inputs))


# ------------------------------------------------------------------------------------------------ sequence-level
@register_policy_loss("gspo")
def gspo_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``gspo``: PPO clipping of the per-token ratio ``s_i,t = sg(s_i) * p_t / sg(p_t)``, where
    ``log s_i`` is the sequence's mean log-ratio over its loss tokens (``row_sum``: the whole sequence under CP),
    clamped above at 10. ``ppo_kl`` is unclamped; verl reports ``pg_clipfrac_lower`` as 0."""
    cfg, lp = inputs.cfg, inputs.log_prob
    neg_approx_kl = lp - inputs.old_log_prob
    seq_lengths = inputs.sum_rows(torch.ones_like(lp)).clamp(min=1)
    seq_log_ratio = inputs.sum_rows(neg_approx_kl) / seq_lengths
    log_ratio = torch.clamp(lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    losses1 = -inputs.advantages * ratio
    losses2 = -inputs.advantages * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    return {
        "pg_losses": _with_is_weights(torch.maximum(losses1, losses2), inputs.is_weights),
        "clipped": _indicator(torch.gt(losses2, losses1), lp),
        "clipped_lower": torch.zeros_like(lp).detach(),
        "approx_kl": (-neg_approx_kl).detach(),
    }


def spread_row_loss(row_loss: torch.Tensor, inputs: PolicyLossInputs, token_count: torch.Tensor) -> torch.Tensor:
    """A per-sequence loss ``[B]`` as per-token losses ``[B, T]`` whose sum over the sequence's loss tokens (over
    every CP rank) is ``row_loss``, with ``row_loss``'s own gradient on this rank's tokens.

    The value is shared evenly over the sequence's tokens (``token_count`` of them in all); the gradient part is
    ``row_loss - sg(row_loss)`` (0 in value) spread over this rank's tokens only, so that its sum there carries
    exactly the gradient ``row_loss`` has through this rank's tokens (``row_sum`` is differentiable locally only).
    """
    mask = inputs.response_mask.to(row_loss.dtype)
    local_count = mask.sum(-1)
    value = row_loss.detach() / torch.where(token_count > 0, token_count, torch.ones_like(token_count))
    grad = (row_loss - row_loss.detach()) / torch.where(local_count > 0, local_count, torch.ones_like(local_count))
    return (value + grad).unsqueeze(-1) * mask


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``geo_mean`` (GMPO): the sequence loss ``-mean_t(A) * exp(mean_t(l_t))`` with ``l_t`` the log-ratio
    clipped to ``[-clip_ratio_low, clip_ratio_high]`` on the side the advantage's sign selects, times the geometric
    mean of the rollout IS weights; averaged over every row (:data:`ROW_MEAN`: verl's ``torch.mean``; it ignores
    ``actor.loss_agg_mode``). The sequence means go through ``row_sum``. ``ppo_kl`` is unclamped."""
    cfg, adv = inputs.cfg, inputs.advantages
    neg_approx_kl = inputs.log_prob - inputs.old_log_prob
    sign = torch.sign(adv)
    clamped = torch.clamp(neg_approx_kl, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    clipped_log_ratio = sign * torch.min(sign * neg_approx_kl, sign * clamped)
    count = inputs.sum_rows(torch.ones_like(neg_approx_kl)).detach()
    ratio = torch.exp(inputs.sum_rows(clipped_log_ratio) / (count + GEO_MEAN_EPS))
    row_loss = -(inputs.sum_rows(adv) / (count + GEO_MEAN_EPS)) * ratio
    if inputs.is_weights is not None:
        log_w = torch.log(inputs.is_weights + GEO_MEAN_IS_EPS)
        row_loss = row_loss * torch.exp(inputs.sum_rows(log_w) / (count + GEO_MEAN_EPS))
    clipped = torch.ne(neg_approx_kl, clamped)
    return {
        "pg_losses": spread_row_loss(row_loss, inputs, count),
        "clipped": _indicator(clipped & (adv > 0), adv),
        "clipped_lower": _indicator(clipped & (adv < 0), adv),
        "approx_kl": (-neg_approx_kl).detach(),
        "loss_agg_mode": ROW_MEAN,
    }


# ------------------------------------------------------------------------------------------------ covariance-based
@register_policy_loss("clip_cov")
def clip_cov_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``clip_cov``: PPO-clip (no dual clip, unclamped ratio) whose gradient is cut on a random sample of
    ``max(int(clip_cov_ratio * tokens), 1)`` tokens among those not clipped by PPO whose centred covariance
    ``(A - mean A)(log_prob - mean log_prob)`` lies in ``(clip_cov_lb, clip_cov_ub)``.

    Like verl, the means, the token count and the sample are those of this micro-batch (and of this CP rank's
    tokens): the selection, unlike the aggregation, depends on the split. The sample draws from torch's default
    generator exactly as verl does (``torch.randperm``). ``pg_clipfrac`` is the cut fraction; no lower fraction.
    """
    cfg, adv, lp, mask = inputs.cfg, inputs.advantages, inputs.log_prob, inputs.response_mask
    pl = cfg.policy_loss
    neg_approx_kl = lp - inputs.old_log_prob
    ratio = torch.exp(neg_approx_kl)
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    valid = mask > 0
    with torch.no_grad():
        cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
        cov = cov.masked_fill(~valid | ((losses2 > losses1) & valid), -torch.inf)
        clip_num = max(int(pl.clip_cov_ratio * mask.sum().item()), 1)
        candidates = torch.nonzero((cov < pl.clip_cov_ub) & (cov > pl.clip_cov_lb) & valid)
        if len(candidates) > 0:
            perm = torch.randperm(len(candidates))
            candidates = candidates[perm[: min(clip_num, len(candidates))]]
        corr = torch.ones_like(adv)
        corr[candidates[:, 0], candidates[:, 1]] = 0
    return {
        "pg_losses": _with_is_weights(torch.maximum(losses1, losses2) * corr, inputs.is_weights),
        "clipped": _indicator(corr == 0, adv),
        "approx_kl": (-neg_approx_kl).detach(),
    }


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``kl_cov``: the unclipped ``-A r`` plus ``ppo_kl_coef * |log r|`` on the top
    ``max(1, int(kl_cov_ratio * tokens))`` tokens by centred covariance ``(A - mean A)(log_prob - mean log_prob)``.

    Like verl, the statistics and the top-k are those of this micro-batch (and CP rank); ties break as torch's CPU
    ``topk`` does, where verl computes it. ``ppo_kl`` is verl's mean of ``|log r|``; no clip fraction.
    """
    pl, adv, lp = inputs.cfg.policy_loss, inputs.advantages, inputs.log_prob
    neg_approx_kl = lp - inputs.old_log_prob
    abs_kl = neg_approx_kl.abs()
    ratio = torch.exp(neg_approx_kl)
    pg_losses = -adv * ratio
    valid = inputs.response_mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid) > 0:
        with torch.no_grad():
            valid_adv = adv[valid].detach().reshape(-1).cpu()
            valid_lp = lp[valid].detach().reshape(-1).cpu()
            cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * pl.kl_cov_ratio)), largest=True).indices
            chosen = flat_valid[top.to(flat_valid.device)]
        penalised = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
        penalised[chosen] = True
        penalised = penalised.reshape(adv.shape)
        pg_losses = torch.where(penalised, pg_losses + pl.ppo_kl_coef * abs_kl, pg_losses)
    return {"pg_losses": _with_is_weights(pg_losses, inputs.is_weights), "approx_kl": abs_kl.detach()}


# ------------------------------------------------------------------------------------------------ rollout correction
@register_policy_loss("bypass_mode")
def bypass_mode_policy_loss(inputs: PolicyLossInputs) -> Terms:
    """verl's ``bypass_mode``: the old policy *is* the rollout policy (``rollout_log_prob``, whatever
    ``old_log_prob`` holds), with verl's rollout correction (``actor.policy_loss.rollout_correction``,
    ``algo/rollout_correction.py``) on ``log_prob - rollout_log_prob``:

    * rejection sampling (``rollout_rs``, ``rollout_rs_threshold``): the rejected tokens (whole rows for ``seq_*``)
      leave the returned ``loss_mask``; they keep counting in the global normalisers (verl's ``global_batch_info``);
    * ``loss_type=ppo_clip``: dual-clip PPO against the rollout log-probs, no IS weight (the ratio is the IS ratio);
    * ``loss_type=reinforce``: ``-A * log_prob * w`` with ``w`` the detached truncated IS weights (``rollout_is``:
      token, sequence or null = none; ``rollout_is_threshold``, ``rollout_is_batch_normalize``: over this
      micro-batch's rows, as verl's single-process path); ``ppo_kl`` is the unclamped ``rollout - log_prob``.

    ``inputs.is_weights`` (``algorithm.rollout_is_threshold``) is ignored, as verl ignores ``rollout_is_weights``.
    """
    rc = inputs.cfg.policy_loss.rollout_correction
    if inputs.rollout_log_prob is None:
        raise ValueError("actor.policy_loss.loss_mode=bypass_mode needs the rollout log-probs of the batch")
    rollout, lp, mask = inputs.rollout_log_prob, inputs.log_prob, inputs.response_mask
    log_ratio = (lp - rollout).detach()
    keep = mask.to(lp.dtype).detach()
    if rc.rollout_rs is not None:
        keep = rejection_keep_mask(log_ratio, mask, inputs.sum_rows, rc.rollout_rs, rc.rollout_rs_threshold)
    if rc.loss_type == "ppo_clip":
        cfg = inputs.cfg
        terms = compute_policy_loss_terms(lp, rollout, inputs.advantages, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                          cfg.clip_ratio_c)  # fmt: skip
        terms.pop("ratio")
        return {**terms, "loss_mask": keep}
    if rc.loss_type != "reinforce":
        raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {rc.loss_type!r}")
    pg_losses = -inputs.advantages * lp
    if rc.rollout_is is not None:
        weights = rollout_is_weights(log_ratio, mask, inputs.sum_rows, rc.rollout_is, rc.rollout_is_threshold,
                                     rc.rollout_is_batch_normalize)  # fmt: skip
        pg_losses = pg_losses * weights
    return {"pg_losses": pg_losses, "approx_kl": -log_ratio, "loss_mask": keep}
