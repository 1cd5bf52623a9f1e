"""verl 0.9.1's other critic-free outcome estimators: Pass@k GRPO, OPO, GPG, ReMax, GDPO and the vectorised GRPO and
RLOO (``verl/trainer/ppo/core_algos.py``), registered under verl's names.

Same conventions as ``algo/advantages.py``: ``scores[B]`` are sequence rewards, ``group_ids[B]`` the prompt of each
response, ``response_mask[B, T]``; group statistics in float64, results cast to the scores' dtype; every function is
pure (no process groups) and returns ``(advantages[B, T], returns[B, T])``. Where verl differs from itself
(``rloo`` vs ``rloo_vectorized`` on groups of one) each keeps verl's own behaviour. Deliberate differences from verl
are named in ``docs/verl_config_mapping.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_dapo.algo.advantages import (
    AdvantageInputs,
    GroupIds,
    _broadcast,
    _check,
    _out_dtype,
    compute_grpo_advantages,
    group_index,
    group_mean_std,
)
from megatron_dapo.algo.masked import masked_whiten
from megatron_dapo.algo.registry import EstimatorNeeds, register_adv_estimator

OTB_EPSILON = 1e-8  # verl's default (its trainer passes none)

__all__ = [
    "compute_gdpo_advantages",
    "compute_gpg_advantages",
    "compute_grpo_passk_advantages",
    "compute_opo_advantages",
    "compute_optimal_token_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_vectorized_advantages",
]


@torch.no_grad()
def compute_grpo_passk_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv:2503.19595): only the best response of a group is credited, with ``r_max - r_second``
    (divided by the group's unbiased std + ``epsilon`` with ``norm_by_std``); every other response gets 0. Ties for the
    best go to the first in batch order (``torch.topk``'s choice, as verl). Every group needs two or more responses."""
    _check(scores, group_ids, response_mask)
    index, num_groups = group_index(group_ids, device=scores.device)
    s = scores.detach().to(torch.float64)
    adv = torch.zeros_like(s)
    for g in range(num_groups):
        rows = (index == g).nonzero(as_tuple=True)[0]
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per group; group {g} has {rows.numel()}")
        top, where = torch.topk(scores.detach()[rows], 2)  # in the scores' dtype, as verl picks the best
        gap = s[rows[where[0]]] - s[rows[where[1]]]
        adv[rows[where[0]]] = gap / (s[rows].std() + epsilon) if norm_by_std else gap
    out = _broadcast(adv, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_opo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): the baseline is the group's length-weighted mean reward ``Σ len·r / Σ len`` (0 for a
    group of one), so longer responses weigh more in the baseline."""
    _check(scores, group_ids, response_mask)
    index, num_groups = group_index(group_ids, device=scores.device)
    s = scores.detach().to(torch.float64)
    lengths = response_mask.to(torch.float64).sum(-1)
    weighted = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, lengths * s)
    total = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, lengths)
    counts = torch.bincount(index, minlength=num_groups)
    baseline = torch.where(counts > 1, weighted / total, torch.zeros_like(total))[index]
    out = _broadcast(s - baseline, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_gpg_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor, f_norm: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546): ``alpha · (r - group mean) / f_norm`` with ``alpha = B / #(rows with a non-zero
    reward)`` (at least 1 in the divisor), which scales up batches where few responses are rewarded."""
    _check(scores, group_ids, response_mask)
    mean, _, _ = group_mean_std(scores, group_ids)
    s = scores.detach().to(torch.float64)
    alpha = len(s) / max(int(torch.count_nonzero(scores)), 1)
    out = _broadcast(alpha * (s - mean) / f_norm, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_rloo_vectorized_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: ``(c·r - Σ_group r) / (c - 1)`` for a group of ``c > 1``; unlike ``rloo``, a group of one
    gets advantage 0 (verl's two implementations differ there, and each is kept)."""
    _check(scores, group_ids, response_mask)
    index, num_groups = group_index(group_ids, device=scores.device)
    s = scores.detach().to(torch.float64)
    counts = torch.bincount(index, minlength=num_groups).to(torch.float64)[index]
    sums = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, s)[index]
    adv = (counts * s - sums) / (counts - 1).clamp_min(1) * (counts > 1)
    out = _broadcast(adv, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_remax_advantages(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): the reward-to-go minus the reward of the prompt's greedy response
    (``reward_baselines[B]``, generated and scored by the rollout phase); ``returns`` is the reward-to-go."""
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines has shape {tuple(reward_baselines.shape)}; expected [{token_level_rewards.shape[0]}]"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    return returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask, returns


@torch.no_grad()
def compute_gdpo_advantages(
    components: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    weights: Optional[Sequence[float]] = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): each reward dimension ``components[:, k]`` is normalised within its group as GRPO
    does, the results are summed with ``weights`` (1 each by default) and whitened over the batch's tokens, so a
    dominant reward does not drown the others."""
    if components.dim() != 2 or components.shape[0] != response_mask.shape[0]:
        raise ValueError(f"components must be [B, K] with B={response_mask.shape[0]}, got {tuple(components.shape)}")
    w = [1.0] * components.shape[1] if weights is None else list(weights)
    if len(w) != components.shape[1]:
        raise ValueError(f"{len(w)} GDPO weights for {components.shape[1]} reward components")
    total = None
    for k in range(components.shape[1]):
        adv, _ = compute_grpo_advantages(components[:, k], group_ids, response_mask, norm_by_std, epsilon)
        total = w[k] * adv if total is None else total + w[k] * adv
    out = masked_whiten(total, response_mask) * response_mask.to(total.dtype)
    return out, out


def _reward_to_go(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _zero_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """A group's single longest response keeps no baseline past the second-longest one's length (nothing to
    compare it with there)."""
    order = torch.sort(lengths).values
    longest, second = int(order[-1]), int(order[-2])
    at_max = (lengths == longest).nonzero(as_tuple=True)[0]
    if at_max.numel() == 1 and longest > second:
        baselines[rows[int(at_max[0])], second:] = 0.0


def _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, mask) -> torch.Tensor:
    """``W_t = Σ_{j<=t} (1 - 2π_j + Σπ²_j) · ρ̄_j²`` (ρ̄: the truncated IS weight, 1 without), the cumulative
    path-variance proxy of verl's optimal token baseline, ``[B, T]`` float64."""
    w = 1 - 2 * old_log_probs.double().exp() + sum_pi_squared.double()
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.double() ** 2
    return (w * mask).cumsum(-1)


@torch.no_grad()
def compute_optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
    compact: bool = False,
    handle_zero_tail: bool = True,
    epsilon: float = OTB_EPSILON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl's ``optimal_token_baseline``; ``compact`` = ``tir_optimal_token_baseline``): at
    each step ``t`` a group's baseline is ``B_t = Σ_i G_it W_it / (Σ_i W_it + ε)`` over its responses, with ``G`` the
    reward-to-go and ``W`` the path-variance proxy (``_path_variance``); advantages ``G - B``, returns ``G``. With
    ``compact`` (multi-turn: tool tokens masked inside a response), steps count a response's masked tokens only, so
    the k-th sampled token of each response is compared with the others' k-th. A group of one has no baseline."""
    mask = response_mask.double()
    returns = _reward_to_go(token_level_rewards.double(), mask)
    weight = _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, mask)
    lengths = mask.sum(-1).long()
    if compact:  # each row's masked tokens moved to its first positions
        order = torch.sort((1 - mask) * mask.shape[-1] + torch.arange(mask.shape[-1]), dim=-1, stable=True).indices
        pack = lambda t: t.gather(-1, order) * (torch.arange(mask.shape[-1]) < lengths.unsqueeze(-1))  # noqa: E731
        g, w, m = pack(returns), pack(weight), pack(mask)
    else:
        g, w, m = returns, weight, mask
    baselines = torch.zeros_like(g)
    index, num_groups = group_index(group_ids)
    for group in range(num_groups):
        rows = [i for i in (index == group).nonzero(as_tuple=True)[0].tolist() if not compact or lengths[i] > 0]
        if len(rows) < 2:
            continue
        num = (g[rows] * w[rows] * m[rows]).sum(0)
        baselines[rows] = num / ((w[rows] * m[rows]).sum(0) + epsilon)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[rows])
    adv = (g - baselines) * m
    if compact:  # back to the response positions
        adv = torch.zeros_like(adv).scatter(-1, order, adv) * mask
    dtype = _out_dtype(token_level_rewards)
    return adv.to(dtype), returns.to(dtype)


@register_adv_estimator("optimal_token_baseline", needs=EstimatorNeeds(sum_pi_squared=True))
def _otb(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return _token_baseline(x, compact=False)


@register_adv_estimator("tir_optimal_token_baseline", needs=EstimatorNeeds(sum_pi_squared=True))
def _tir_otb(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return _token_baseline(x, compact=True)


def _token_baseline(x: AdvantageInputs, compact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.token_level_rewards is None or x.old_log_probs is None or x.sum_pi_squared is None:
        raise ValueError(
            "the optimal-token-baseline estimators need token_level_rewards, old_log_probs and sum_pi_squared [B, T] "
            "(the trainer's proximal forward computes them)"
        )
    return compute_optimal_token_baseline_advantages(
        x.token_level_rewards, x.response_mask, x.group_ids, x.old_log_probs, x.sum_pi_squared,
        x.rollout_is_weights, compact=compact,
    )  # fmt: skip


@register_adv_estimator("grpo_passk")
def _grpo_passk(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_grpo_passk_advantages(x.scores, x.group_ids, x.response_mask, x.norm_adv_by_std_in_grpo, x.epsilon)


@register_adv_estimator("grpo_vectorized")
def _grpo_vectorized(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO: the same estimate as ``grpo`` (its group std has no variance floor either)."""
    return compute_grpo_advantages(x.scores, x.group_ids, x.response_mask, x.norm_adv_by_std_in_grpo, x.epsilon)


@register_adv_estimator("opo")
def _opo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_opo_advantages(x.scores, x.group_ids, x.response_mask)


@register_adv_estimator("gpg")
def _gpg(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_gpg_advantages(x.scores, x.group_ids, x.response_mask)


@register_adv_estimator("rloo_vectorized")
def _rloo_vectorized(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_rloo_vectorized_advantages(x.scores, x.group_ids, x.response_mask)


@register_adv_estimator("remax", needs=EstimatorNeeds(greedy_baseline=True))
def _remax(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.token_level_rewards is None or x.reward_baselines is None:
        raise ValueError("adv_estimator 'remax' needs token_level_rewards[B, T] and reward_baselines[B]")
    return compute_remax_advantages(x.token_level_rewards, x.reward_baselines, x.response_mask)


@register_adv_estimator("gdpo", needs=EstimatorNeeds(reward_components=True))
def _gdpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.reward_components is None:
        raise ValueError("adv_estimator 'gdpo' needs reward_components[B, K] (algorithm.gdpo_reward_keys)")
    return compute_gdpo_advantages(
        x.reward_components, x.group_ids, x.response_mask, x.reward_weights, x.norm_adv_by_std_in_grpo, x.epsilon
    )
