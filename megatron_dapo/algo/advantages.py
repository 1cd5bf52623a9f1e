"""Outcome-reward advantage estimators: GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline (verl 0.9.1 semantics);
verl's other critic-free ones are in ``algo/outcome_estimators.py``.

Shapes: ``B`` responses, ``T`` response tokens (right-padded). ``scores[B]`` is the sequence-level reward (verl:
``token_level_rewards.sum(-1)``); ``response_mask[B, T]`` marks valid response tokens. ``group_ids[B]`` names the
prompt each response was sampled from: any hashable ids (str/int/...) as a list/tuple/NumPy array, or an integer
tensor. All functions are pure (no process groups); group statistics are computed in float64 and cast back to the
dtype of ``scores`` (float32 if ``scores`` is not floating), so results agree with verl's float32 loops to rounding.

Estimators are registered by name (``algo/registry.py``); ``compute_advantages`` dispatches on
``algorithm.adv_estimator``.

Every estimator returns ``(advantages[B, T], returns[B, T])``; outcome estimators return the same tensor twice
(as verl does), REINFORCE++ returns the discounted returns as ``returns``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_dapo.algo.masked import masked_whiten
from megatron_dapo.algo.registry import ADV_ESTIMATORS, register_adv_estimator

GroupIds = Sequence[Hashable] | np.ndarray | torch.Tensor

__all__ = [
    "AdvantageInputs",
    "GroupIds",
    "compute_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_rloo_advantages",
    "group_index",
    "group_mean_std",
]


def group_index(group_ids: GroupIds, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Map ``group_ids[B]`` to dense group indices ``[B]`` (int64, numbered in order of first appearance).

    Returns ``(index[B], num_groups)``.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        ids = group_ids.tolist()
    else:
        ids = group_ids.tolist() if isinstance(group_ids, np.ndarray) else list(group_ids)
    mapping: dict[Hashable, int] = {}
    index = [mapping.setdefault(g, len(mapping)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(mapping)


def _check(scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor) -> None:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask must be [B, T] with B={scores.shape[0]}, got shape {tuple(response_mask.shape)}"
        )
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries, scores has {scores.shape[0]}")


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.float32


def group_mean_std(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group statistics in float64, verl conventions.

    Returns ``(mean[B], std[B], size[B])``: the mean and unbiased (``torch.std``) standard deviation of the
    response's group, and the group size. Groups of one get mean 0 and std 1 (verl's convention).
    """
    index, num_groups = group_index(group_ids, device=scores.device)
    s = scores.detach().to(torch.float64)
    counts = torch.bincount(index, minlength=num_groups).to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, s)
    mean_g = sums / counts
    centred = s - mean_g[index]
    sq = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, centred * centred)
    single = counts == 1
    std_g = torch.sqrt(sq / torch.where(single, torch.ones_like(counts), counts - 1))
    mean_g = torch.where(single, torch.zeros_like(mean_g), mean_g)
    std_g = torch.where(single, torch.ones_like(std_g), std_g)
    return mean_g[index], std_g[index], counts[index]


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return per_seq.to(dtype).unsqueeze(-1) * response_mask.to(dtype)


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group_mean) / (group_std + epsilon)`` broadcast over the response mask.

    Args:
        scores: ``[B]`` sequence rewards.
        group_ids: ``[B]`` prompt ids.
        response_mask: ``[B, T]``.
        norm_by_std: divide by the group std (GRPO); False gives Dr.GRPO (mean-centred only).
        epsilon: added to the std.

    Groups of one use mean 0 and std 1, so their advantage is ``score / (1 + epsilon)`` (verl). The std is the
    unbiased ``torch.std``; zero-variance groups get advantage 0.

    Returns:
        ``(advantages[B, T], returns[B, T])``, the same tensor (verl), zero outside the mask.
    """
    _check(scores, group_ids, response_mask)
    mean, std, _ = group_mean_std(scores, group_ids)
    s = scores.detach().to(torch.float64)
    adv = (s - mean) / (std + epsilon) if norm_by_std else s - mean
    out = _broadcast(adv, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_rloo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``score - mean(other scores of the group)`` = ``n/(n-1) * (score - group_mean)``.

    Groups of one keep their raw score (verl). ``epsilon`` is accepted for interface symmetry and unused (as in
    verl). Shapes as in :func:`compute_grpo_advantages`; returns ``(advantages[B, T], advantages[B, T])``.
    """
    _check(scores, group_ids, response_mask)
    mean, _, size = group_mean_std(scores, group_ids)
    s = scores.detach().to(torch.float64)
    factor = size / torch.clamp(size - 1, min=1)
    adv = torch.where(size > 1, s * factor - mean * factor, s)
    out = _broadcast(adv, response_mask, _out_dtype(scores))
    return out, out


@torch.no_grad()
def compute_reinforce_pp_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the masked tokens of the whole batch.

    Walking backwards, ``new = r_t + gamma * running``; a valid token (mask 1) gets ``returns[:, t] = new`` and
    takes ``running = new``; a masked-out token (padding, or a multi-turn observation span) gets return 0 and passes
    ``running`` through unchanged, so later rewards reach earlier turns (verl 0.9.1). Advantages are
    ``masked_whiten(returns, mask) * mask``.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]``; must select at least two tokens in total (unbiased variance, as verl).
        gamma: discount.

    Returns:
        ``(advantages[B, T], returns[B, T])``.
    """
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    rewards = token_level_rewards.detach()
    mask = response_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        new_running = rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        running = new_running * mask[:, t] + running * (1 - mask[:, t])
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


@torch.no_grad()
def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``score - group_mean`` (groups of one: mean 0), broadcast over the mask, then whitened
    over the masked tokens of the whole batch and re-masked. ``epsilon`` is unused (verl).

    Returns ``(advantages[B, T], advantages[B, T])``. The mask must select at least two tokens in total.
    """
    _check(scores, group_ids, response_mask)
    mean, _, _ = group_mean_std(scores, group_ids)
    dtype = _out_dtype(scores)
    centred = _broadcast(scores.detach().to(torch.float64) - mean, response_mask, dtype)
    mask = response_mask.to(dtype)
    out = masked_whiten(centred, response_mask) * mask
    return out, out


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator gets: ``scores[B]`` (sequence rewards), ``group_ids[B]``, ``response_mask[B, T]``,
    ``token_level_rewards[B, T]`` (None when only sequence rewards exist) and the ``algorithm.*`` settings."""

    scores: torch.Tensor
    group_ids: GroupIds
    response_mask: torch.Tensor
    token_level_rewards: torch.Tensor | None = None
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    epsilon: float = 1e-6
    # ReMax: the reward of each row's prompt's greedy response, [B] (algo/outcome_estimators.py).
    reward_baselines: torch.Tensor | None = None
    # GDPO: the scorer's reward dimensions named by algorithm.gdpo_reward_keys, [B, K], and their weights.
    reward_components: torch.Tensor | None = None
    reward_weights: Sequence[float] | None = None
    # The optimal-token-baseline estimators: the old policy's log-probs, its Σ π² per token, and the truncated-IS
    # weights against the rollout when the run has them, all [B, T].
    old_log_probs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None


@register_adv_estimator("grpo")
def _grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_grpo_advantages(x.scores, x.group_ids, x.response_mask, x.norm_adv_by_std_in_grpo, x.epsilon)


@register_adv_estimator("rloo")
def _rloo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_rloo_advantages(x.scores, x.group_ids, x.response_mask, x.epsilon)


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if x.token_level_rewards is None:
        raise ValueError("adv_estimator 'reinforce_plus_plus' needs token_level_rewards[B, T]")
    return compute_reinforce_pp_advantages(x.token_level_rewards, x.response_mask, x.gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_reinforce_pp_baseline_advantages(x.scores, x.group_ids, x.response_mask, x.epsilon)


def compute_advantages(estimator: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``estimator`` (``algorithm.adv_estimator``) on ``AdvantageInputs(**inputs)``."""
    return ADV_ESTIMATORS.get(estimator)(AdvantageInputs(**inputs))
