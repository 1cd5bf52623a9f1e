"""RL algorithm math: advantages, policy loss and aggregation, KL, dynamic sampling.

Pure functions on tensors (no process groups); vocab-parallel log-probs and entropy live in
``megatron_dapo.algo.logprobs``.
"""

from megatron_dapo.algo import outcome_estimators  # noqa: F401 - registers verl's other estimators
from megatron_dapo.algo.advantages import (
    compute_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
)
from megatron_dapo.algo.dynamic_sampling import DynamicSamplingAccumulator, filter_groups
from megatron_dapo.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    get_kl_controller,
    kl_penalty,
)
from megatron_dapo.algo.loss_aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss_terms,
    compute_rollout_is_weights,
    policy_loss_metric_sums,
)
from megatron_dapo.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "DynamicSamplingAccumulator",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty_to_rewards",
    "compute_advantages",
    "compute_grpo_advantages",
    "compute_policy_loss_terms",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "compute_rloo_advantages",
    "compute_rollout_is_weights",
    "filter_groups",
    "get_kl_controller",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_metric_sums",
]
