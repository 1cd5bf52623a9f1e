"""A scored batch's rewards → advantages, as verl's ``compute_advantage`` step: the KL penalty in the reward (with
``algorithm.use_kl_in_reward``), the registered estimator, and the truncated-IS weights against the rollout."""

from __future__ import annotations

from typing import Any, Optional

from megatron_dapo.algo.advantages import compute_advantages
from megatron_dapo.algo.kl import apply_kl_penalty_to_rewards
from megatron_dapo.algo.loss_aggregation import compute_rollout_is_weights
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import AlgorithmConfig


def batch_advantages(
    batch: TrainBatch, algorithm: AlgorithmConfig, kl_ctrl: Any, is_threshold: Optional[float]
) -> dict[str, float]:
    """Fill ``token_level_rewards`` (scores, minus the KL penalty with ``use_kl_in_reward``), ``advantages`` and
    ``returns``, and the truncated-IS weights ``min(old / rollout, is_threshold)`` when the old-policy log-probs exist
    (else the update computes them from its own forward); ``is_threshold`` is the run's resolved truncation
    (``RunPlan.is_threshold``: the off-policy correction or ``algorithm.rollout_is_threshold``). Updates ``kl_ctrl``
    from the batch's KL; returns the KL metrics."""
    metrics: dict[str, float] = {}
    rewards = batch.token_level_scores
    if algorithm.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty_to_rewards(
            rewards,
            batch.old_log_probs,
            batch.ref_log_probs,
            batch.model_mask,
            kl_ctrl.value,
            algorithm.kl_penalty,
        )
        # verl passes the number of responses (batch rows) as n_steps.
        kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=int(rewards.shape[0]))
        metrics.update(kl_metrics)
    batch.token_level_rewards = rewards
    if is_threshold and batch.old_log_probs is not None:  # before the estimator: the token baselines weigh by them
        batch.rollout_is_weights = compute_rollout_is_weights(
            batch.old_log_probs, batch.rollout_log_probs, batch.model_mask, is_threshold
        )
    trained_rows = ~batch.filler
    advantages, returns = compute_advantages(
        algorithm.adv_estimator,
        scores=rewards.sum(-1),
        group_ids=batch.group_ids,
        # Filler groups of an exhausted step are not trained: keep them out of batch-level statistics.
        response_mask=batch.model_mask * trained_rows.unsqueeze(-1),
        token_level_rewards=rewards,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        gamma=algorithm.gamma,
        reward_baselines=batch.reward_baselines,
        reward_components=batch.reward_components,
        reward_weights=algorithm.gdpo_reward_weights,
        old_log_probs=batch.old_log_probs,
        sum_pi_squared=batch.sum_pi_squared,
        rollout_is_weights=batch.rollout_is_weights,
    )
    batch.advantages, batch.returns = advantages.float(), returns.float()
    return metrics
