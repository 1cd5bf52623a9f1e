"""What the config alone decides, as pure functions returning problem lines: each value's range, settings that
cannot work together, the learning-rate schedule and the algorithm names. Each rule takes the config sections it
reads; the tables below say which (``Rule.reads``), and :func:`config_problems` runs every rule of them once.
``run_rules.py`` holds what needs the model and the world; ``plan.plan_problems`` runs both, once per command.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import megatron_dapo.algo.advantages  # noqa: F401  (the built-in estimators register themselves on import)
import megatron_dapo.algo.loss_aggregation  # noqa: F401  (so do the built-in policy losses)
from megatron_dapo.algo.registry import ADV_ESTIMATORS, POLICY_LOSSES, load_user_algorithms
from megatron_dapo.algo.rollout_correction import (
    IS_LEVELS,
    LOSS_TYPES,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)
from megatron_dapo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from megatron_dapo.distill.config_checks import distillation_problems, distillation_run_problems
from megatron_dapo.judge.judge_rules import judge_problems
from megatron_dapo.rm.rm_rules import reward_model_problems

# --------------------------------------------------------------------------------------------------- value checks


class _Problems(list):
    """Problem lines, one per bad value, each naming the key, the value and what is valid."""

    def need(self, key: str, value: Any, ok: bool, expected: str, fix: str = "") -> None:
        if not ok:
            self.append(f"{key}={value!r}: expected {expected}" + (f"; {fix}" if fix else ""))

    def positive_int(self, key: str, value: Any, allow_none: bool = False) -> None:
        ok = (allow_none and value is None) or (isinstance(value, int) and value >= 1)
        self.need(key, value, ok, "an integer >= 1")

    def in_unit(self, key: str, value: float, low_open: bool = False, high_open: bool = True) -> None:
        lo_ok = value > 0 if low_open else value >= 0
        hi_ok = value < 1 if high_open else value <= 1
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        self.need(key, value, lo_ok and hi_ok, f"a value in {interval}")

    def finite(self, key: str, value: float) -> None:
        self.need(key, value, math.isfinite(value), "a finite number")


def _model_parallel_ranges(m: ModelConfig, p: ParallelConfig) -> list[str]:
    out = _Problems()
    out.positive_int("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)
    out.need("model.attention_backend", m.attention_backend, m.attention_backend in ("sdpa", "local"), "sdpa or local")
    out.in_unit("model.attention_dropout", m.attention_dropout)
    out.in_unit("model.hidden_dropout", m.hidden_dropout)
    out.positive_int("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size)
    out.positive_int("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size)
    out.positive_int("parallel.virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size, True)
    out.positive_int("parallel.context_parallel_size", p.context_parallel_size)
    out.positive_int("parallel.expert_model_parallel_size", p.expert_model_parallel_size)
    out.positive_int("parallel.expert_tensor_parallel_size", p.expert_tensor_parallel_size, True)
    out.positive_int("parallel.ddp_bucket_size", p.ddp_bucket_size, True)
    return out


def _checkpoint_data_ranges(c: CheckpointConfig, d: DataConfig) -> list[str]:
    out = _Problems()
    out.need(
        "checkpoint.save_freq",
        c.save_freq,
        c.save_freq == -1 or c.save_freq >= 1,
        "-1 (save at the end only) or a number of steps >= 1",
    )
    out.positive_int("data.max_prompt_length", d.max_prompt_length)
    out.positive_int("data.max_response_length", d.max_response_length)
    out.positive_int("data.train_batch_size", d.train_batch_size)
    out.positive_int("data.gen_batch_size", d.gen_batch_size, True)
    out.positive_int("data.val_batch_size", d.val_batch_size, True)
    return out


def _optim_ranges(out: _Problems, o: OptimConfig) -> None:
    out.need("actor.optim.lr", o.lr, o.lr > 0 and math.isfinite(o.lr), "a finite value > 0")
    out.need("actor.optim.min_lr", o.min_lr, 0 <= o.min_lr <= o.lr, f"a value in [0, actor.optim.lr={o.lr}]")
    out.need("actor.optim.lr_warmup_steps", o.lr_warmup_steps, o.lr_warmup_steps >= 0, "an integer >= 0")
    out.in_unit("actor.optim.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio, high_open=False)
    out.need("actor.optim.weight_decay", o.weight_decay, 0 <= o.weight_decay < 1, "a value in [0, 1)")
    out.in_unit("actor.optim.adam_beta1", o.adam_beta1)
    out.in_unit("actor.optim.adam_beta2", o.adam_beta2)
    out.need("actor.optim.adam_eps", o.adam_eps, o.adam_eps > 0, "a value > 0")
    out.need("actor.optim.clip_grad", o.clip_grad, o.clip_grad >= 0, "a value >= 0 (0 = no clipping)")


def _actor_ranges(a: ActorConfig) -> list[str]:
    out = _Problems()
    _optim_ranges(out, a.optim)
    out.positive_int("actor.ppo_mini_batch_size", a.ppo_mini_batch_size)
    out.positive_int("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu)
    out.positive_int("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu)
    out.positive_int("actor.ppo_epochs", a.ppo_epochs)
    out.positive_int("actor.log_prob_micro_batch_size_per_gpu", a.log_prob_micro_batch_size_per_gpu)
    out.positive_int("actor.recompute_num_layers", a.recompute_num_layers)
    out.need(
        "actor.clip_ratio_low",
        a.clip_ratio_low,
        0 <= a.clip_ratio_low < 1,
        "a value in [0, 1): the lower clip bound is 1 - clip_ratio_low and must stay positive",
    )
    out.need("actor.clip_ratio_high", a.clip_ratio_high, a.clip_ratio_high >= 0, "a value >= 0")
    out.need("actor.clip_ratio_c", a.clip_ratio_c, a.clip_ratio_c > 1, "a value > 1 (the dual-clip bound, verl's rule)")
    out.finite("actor.entropy_coeff", a.entropy_coeff)
    out.need("actor.kl_loss_coef", a.kl_loss_coef, a.kl_loss_coef >= 0, "a value >= 0")
    aux = a.moe_aux_loss_coeff
    out.need(
        "actor.moe_aux_loss_coeff",
        aux,
        aux is None or (math.isfinite(aux) and aux >= 0),
        "null (from the HF config's router_aux_loss_coef) or a finite value >= 0 (0 = off)",
    )
    z = a.moe_z_loss_coeff
    out.need("actor.moe_z_loss_coeff", z, math.isfinite(z) and z >= 0, "a finite value >= 0 (0 = off)")
    _policy_loss_ranges(out, a)
    return out


# --------------------------------------------------------------------------------------------------- policy loss


def _policy_loss_ranges(out: _Problems, a: ActorConfig) -> None:
    """The keys of verl's policy losses (``actor.policy_loss.*``, ``actor.tau_pos/tau_neg``), checked whichever
    loss is chosen (a bad value is a mistake either way), and what the chosen loss requires."""
    pl = a.policy_loss
    key = "actor.policy_loss"
    for name, value in (("clip_cov_ratio", pl.clip_cov_ratio), ("kl_cov_ratio", pl.kl_cov_ratio)):
        out.need(f"{key}.{name}", value, 0 < value <= 1, "a fraction in (0, 1] of the micro-batch's tokens")
    out.finite(f"{key}.clip_cov_lb", pl.clip_cov_lb)
    out.finite(f"{key}.clip_cov_ub", pl.clip_cov_ub)
    if math.isfinite(pl.clip_cov_lb) and math.isfinite(pl.clip_cov_ub):
        out.need(
            f"{key}.clip_cov_ub",
            pl.clip_cov_ub,
            pl.clip_cov_ub > pl.clip_cov_lb,
            f"a value > {key}.clip_cov_lb={pl.clip_cov_lb!r} (the covariance window (lb, ub) would be empty)",
        )
    ok = math.isfinite(pl.ppo_kl_coef) and pl.ppo_kl_coef >= 0
    out.need(f"{key}.ppo_kl_coef", pl.ppo_kl_coef, ok, "a finite value >= 0")
    beta_ok = pl.dro_beta is None or (math.isfinite(pl.dro_beta) and pl.dro_beta > 0)
    out.need(f"{key}.dro_beta", pl.dro_beta, beta_ok, "null or a finite value > 0")
    if pl.loss_mode == "dro" and pl.dro_beta is None:
        out.need(f"{key}.dro_beta", None, False, "a finite value > 0 with loss_mode=dro (DRO's penalty)")
    for name in ("tau_pos", "tau_neg"):
        value = getattr(a, name)
        ok = math.isfinite(value) and value > 0
        out.need(f"actor.{name}", value, ok, "a finite value > 0 (SAPO's gate temperature divides by it)")
    _rollout_correction_ranges(out, pl.rollout_correction, f"{key}.rollout_correction")


def _rollout_correction_ranges(out: _Problems, rc: Any, key: str) -> None:
    """``actor.policy_loss.rollout_correction.*`` (bypass_mode's IS weights and rejection sampling), by verl's rules
    (``algo/rollout_correction.py``'s parsers), whichever loss is chosen."""
    out.need(f"{key}.loss_type", rc.loss_type, rc.loss_type in LOSS_TYPES, " or ".join(LOSS_TYPES))
    ok = rc.rollout_is is None or rc.rollout_is in IS_LEVELS
    out.need(f"{key}.rollout_is", rc.rollout_is, ok, "null (no IS weight), " + " or ".join(IS_LEVELS))
    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as exc:
        expected = "a number > 0 (TIS upper bound) or a quoted 'lower_upper' string (IcePop, 0 < lower <= upper)"
        out.need(f"{key}.rollout_is_threshold", rc.rollout_is_threshold, False, expected, str(exc))
    if rc.rollout_rs is None:
        return
    try:
        options = parse_rs_options(rc.rollout_rs)
    except ValueError as exc:
        out.need(f"{key}.rollout_rs", rc.rollout_rs, False, "null or comma-separated rejection options", str(exc))
        return
    try:
        parse_rs_thresholds(options, rc.rollout_rs_threshold)
    except ValueError as exc:
        expected = (
            f"thresholds for rollout_rs={rc.rollout_rs!r}: positive upper bounds, 'lower_upper' ratio bounds for *_k1"
        )
        out.need(f"{key}.rollout_rs_threshold", rc.rollout_rs_threshold, False, expected, str(exc))


def _sampling_ranges(out: _Problems, prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    out.need(f"{prefix}.temperature", temperature, temperature >= 0, "a value >= 0 (0 = greedy)")
    out.need(f"{prefix}.top_p", top_p, 0 < top_p <= 1, "a value in (0, 1]")
    out.need(f"{prefix}.top_k", top_k, top_k == -1 or top_k >= 1, "-1 (off) or an integer >= 1")


def _rollout_ranges(r: RolloutConfig) -> list[str]:
    out = _Problems()
    out.positive_int("rollout.tensor_model_parallel_size", r.tensor_model_parallel_size)
    out.positive_int("rollout.expert_parallel_size", r.expert_parallel_size)
    out.positive_int("rollout.n", r.n)
    _sampling_ranges(out, "rollout", r.temperature, r.top_p, r.top_k)
    out.in_unit("rollout.gpu_memory_utilization", r.gpu_memory_utilization, low_open=True, high_open=False)
    out.positive_int("rollout.kv_cache_memory_mb", r.kv_cache_memory_mb)
    out.positive_int("rollout.max_num_seqs", r.max_num_seqs)
    out.positive_int("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
    out.positive_int("rollout.max_num_batched_tokens", r.max_num_batched_tokens, True)
    out.need("rollout.sleep_level", r.sleep_level, r.sleep_level in (None, 1, 2), "null (platform default), 1 or 2")
    out.positive_int("rollout.partial_rollout.max_segments", r.partial_rollout.max_segments)
    out.positive_int("rollout.partial_rollout.segment_length", r.partial_rollout.segment_length, True)
    mt = r.multi_turn
    out.positive_int("rollout.multi_turn.max_assistant_turns", mt.max_assistant_turns, True)
    out.positive_int("rollout.multi_turn.max_parallel_calls", mt.max_parallel_calls)
    out.positive_int("rollout.multi_turn.max_tool_response_length", mt.max_tool_response_length)
    out.need("rollout.multi_turn.tool_timeout_s", mt.tool_timeout_s, mt.tool_timeout_s > 0, "a value > 0 (seconds)")
    out.positive_int("rollout.multi_turn.max_concurrent_tool_calls", mt.max_concurrent_tool_calls)
    out.positive_int("rollout.multi_turn.tool_memory_mb", mt.tool_memory_mb, True)
    out.positive_int("rollout.multi_turn.tool_workers", mt.tool_workers)
    wait_s = mt.tool_round_wait_s
    out.need("rollout.multi_turn.tool_round_wait_s", wait_s, wait_s >= 0, "a value >= 0 (seconds)")
    abandon_s = mt.tool_abandon_after_s
    out.need(
        "rollout.multi_turn.tool_abandon_after_s",
        abandon_s,
        abandon_s is None or 0 < abandon_s < mt.tool_timeout_s,
        f"null or a value > 0 and below tool_timeout_s ({mt.tool_timeout_s:g} s)",
    )
    v = r.val_kwargs
    _sampling_ranges(out, "rollout.val_kwargs", v.temperature, v.top_p, v.top_k)
    out.positive_int("rollout.val_kwargs.n", v.n)
    return out


def _algorithm_ranges(al: AlgorithmConfig) -> list[str]:
    out = _Problems()
    out.in_unit("algorithm.gamma", al.gamma, high_open=False)
    out.need("algorithm.kl_ctrl.kl_coef", al.kl_ctrl.kl_coef, al.kl_ctrl.kl_coef >= 0, "a value >= 0")
    out.need("algorithm.kl_ctrl.target_kl", al.kl_ctrl.target_kl, al.kl_ctrl.target_kl > 0, "a value > 0")
    out.need("algorithm.kl_ctrl.horizon", al.kl_ctrl.horizon, al.kl_ctrl.horizon >= 1, "an integer >= 1")
    out.need(
        "algorithm.filter_groups.max_num_gen_batches",
        al.filter_groups.max_num_gen_batches,
        al.filter_groups.max_num_gen_batches >= 0,
        "an integer >= 0 (0 = one pass over the training prompts)",
    )
    out.need(
        "algorithm.rollout_is_threshold",
        al.rollout_is_threshold,
        al.rollout_is_threshold is None or al.rollout_is_threshold > 0,
        "null (off) or a value > 0",
    )
    out.need(
        "algorithm.off_policy.is_threshold",
        al.off_policy.is_threshold,
        1 <= al.off_policy.is_threshold < math.inf,
        "a finite value >= 1 (the truncation of proximal / behaviour)",
    )
    return out


def reward_value_problems(rw: RewardConfig) -> list[str]:
    """The ``reward`` section's ranges and every ``reward.extra_functions`` entry's shape and weight (no file is
    imported here: ``run_rules.reward_function_problems`` imports them)."""
    out = _Problems()
    ob = rw.overlong_buffer
    out.positive_int("reward.overlong_buffer.len", ob.len)
    out.need(
        "reward.overlong_buffer.penalty_factor",
        ob.penalty_factor,
        0 <= ob.penalty_factor < math.inf,
        "a finite value >= 0",
    )
    out.need("reward.num_workers", rw.num_workers, rw.num_workers >= 0, "an integer >= 0 (0 = score in-process)")
    out.need(
        "reward.timeout_s",
        rw.timeout_s,
        0 < rw.timeout_s < math.inf,
        "a value > 0 (seconds per scorer call)",
        "use a large value, e.g. 3600, to debug a slow scorer",
    )
    out.finite("reward.error_score", rw.error_score)
    out.need("reward.max_logged_errors", rw.max_logged_errors, rw.max_logged_errors >= 0, "an integer >= 0")
    out.finite("reward.custom_function.weight", rw.custom_function.weight)
    for i, item in enumerate(rw.extra_functions):
        out.extend(extra_function_spec(item, f"reward.extra_functions[{i}]")[1])
    return out


def _trainer_ranges(t: TrainerConfig) -> list[str]:
    out = _Problems()
    out.positive_int("trainer.total_epochs", t.total_epochs)
    out.positive_int("trainer.total_training_steps", t.total_training_steps, True)
    out.need(
        "trainer.test_freq",
        t.test_freq,
        t.test_freq == -1 or t.test_freq >= 1,
        "-1 (validate at the end only) or a number of steps >= 1",
    )
    out.need(
        "trainer.collective_timeout_s",
        t.collective_timeout_s,
        0 < t.collective_timeout_s < math.inf,
        "a finite value > 0 (seconds)",
    )
    out.positive_int("trainer.max_consecutive_skipped_updates", t.max_consecutive_skipped_updates)
    out.positive_int("trainer.console_every", t.console_every)
    return out


def _placement_async_ranges(pl: PlacementConfig, a: AsyncConfig) -> list[str]:
    out = _Problems()
    out.need("placement.rollout_ranks", pl.rollout_ranks, pl.rollout_ranks >= 0, "an integer >= 0")
    out.need("async.max_staleness", a.max_staleness, a.max_staleness >= 0, "an integer >= 0 (0 = synchronous)")
    out.need("async.queue_groups", a.queue_groups, a.queue_groups >= 0, "an integer >= 0 (0 = automatic)")
    return out


# --------------------------------------------------------------------------------------------------- lr schedule

DECAY_STYLES = ("constant", "cosine", "linear")


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """``lr_warmup_steps`` when positive, else ``int(lr_warmup_steps_ratio × total_steps)`` (verl's rule)."""
    return optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)


def lr_schedule_problems(optim: OptimConfig, total_steps: int, steps_key: Optional[str] = None) -> list[str]:
    """The learning-rate schedule over ``total_steps`` training steps: its fields, and a warm-up shorter than the run
    (megatron-core's scheduler asserts warm-up < decay steps). ``steps_key`` names where the step count comes from
    in the messages (e.g. ``trainer.total_training_steps``)."""
    steps = f"{steps_key}={total_steps}" if steps_key else f"the {total_steps} training steps"
    if total_steps < 1:
        where = f" ({steps_key})" if steps_key else ""
        return [f"the number of training steps{where} must be >= 1 to build the lr schedule, got {total_steps}"]
    problems = []
    if optim.lr_decay_style not in DECAY_STYLES:
        problems.append(f"actor.optim.lr_decay_style={optim.lr_decay_style!r}: expected one of {DECAY_STYLES}")
    if not (optim.lr > 0 and 0 <= optim.min_lr <= optim.lr):
        problems.append(
            f"actor.optim: need lr > 0 and 0 <= min_lr <= lr, got lr={optim.lr}, min_lr={optim.min_lr}; set "
            "actor.optim.lr > 0 and actor.optim.min_lr between 0 and it"
        )
    if not 0.0 <= optim.lr_warmup_steps_ratio <= 1.0:
        problems.append(f"actor.optim.lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio}: expected a value in [0, 1]")
    warmup = warmup_steps(optim, total_steps)
    if warmup >= total_steps:
        problems.append(
            f"actor.optim.lr_warmup_steps={optim.lr_warmup_steps} (lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio}"
            f") gives {warmup} warm-up steps, not fewer than {steps}: the warm-up must be shorter than the "
            f"{total_steps} training steps, or the learning rate would never reach actor.optim.lr; set "
            f"actor.optim.lr_warmup_steps to at most {max(total_steps - 1, 0)} (or train for more steps)"
        )
    return problems


# --------------------------------------------------------------------------------------------------- cross-field


def _batch_and_sampling_problems(a: ActorConfig, d: DataConfig, r: RolloutConfig, al: AlgorithmConfig) -> list[str]:
    problems: list[str] = []
    fg = al.filter_groups
    if a.ppo_mini_batch_size > d.train_batch_size or d.train_batch_size % a.ppo_mini_batch_size:
        problems.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide data.train_batch_size="
            f"{d.train_batch_size}: set actor.ppo_mini_batch_size to a divisor of it (e.g. {d.train_batch_size})"
        )
    if fg.enable and r.n < 2:
        problems.append(
            f"algorithm.filter_groups.enable=true needs rollout.n >= 2 (got {r.n}): a group of one is never filtered; "
            "raise rollout.n or disable algorithm.filter_groups.enable"
        )
    if fg.enable and 0 < fg.max_num_gen_batches and fg.max_num_gen_batches * d.gen_batch_size < d.train_batch_size:
        problems.append(
            f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation batches of "
            f"data.gen_batch_size={d.gen_batch_size} prompts can never fill data.train_batch_size={d.train_batch_size}"
            " even when every group is kept; raise either, or set max_num_gen_batches=0 (one pass over the prompts)"
        )
    if fg.enable and r.temperature == 0:
        problems.append(
            "algorithm.filter_groups.enable=true with rollout.temperature=0: greedy sampling gives all rollout.n "
            "responses of a prompt the same text, so every group has equal rewards and dynamic sampling can never "
            "fill a batch; set rollout.temperature > 0 (e.g. 1.0) or disable algorithm.filter_groups.enable"
        )
    if r.n > 1 and r.temperature == 0 and al.adv_estimator in ("grpo", "rloo"):
        problems.append(
            f"rollout.n={r.n} with rollout.temperature=0: the n greedy responses of a prompt are identical, so every "
            f"group-relative advantage ({al.adv_estimator}) is zero and nothing trains; set "
            "rollout.temperature > 0"
        )
    return problems


def _packing_problems(a: ActorConfig, p: ParallelConfig) -> list[str]:
    if a.use_remove_padding and p.context_parallel_size > 1:
        return [
            f"actor.use_remove_padding=true with parallel.context_parallel_size={p.context_parallel_size}: "
            "packed (THD) micro-batches are not split over context-parallel ranks; set actor.use_remove_padding=false "
            "(padded micro-batches, split as megatron-core expects) or parallel.context_parallel_size=1"
        ]
    return []


def _overlong_problems(rw: RewardConfig, d: DataConfig) -> list[str]:
    ob = rw.overlong_buffer
    if ob.enable and d.max_response_length >= 1 and ob.len >= d.max_response_length:  # any buffer length compares
        return [
            f"reward.overlong_buffer.len={ob.len} must be shorter than data.max_response_length="
            f"{d.max_response_length}: the buffer is the tail of the response budget; lower it (DAPO uses 4096 of "
            "20480)"
        ]
    return []


def _step_schedule_problems(a: ActorConfig, t: TrainerConfig) -> list[str]:
    """The lr schedule over ``trainer.total_training_steps`` when the config sets it (else ``plan.plan_problems``
    checks it over the steps the data gives)."""
    steps = t.total_training_steps
    return [] if steps is None else lr_schedule_problems(a.optim, steps, "trainer.total_training_steps")


def _gdpo_problems(a: AlgorithmConfig) -> list[str]:
    """GDPO needs the reward dimensions it normalises one by one (the reward function's dict keys)."""
    if a.adv_estimator != "gdpo":
        return []
    if not a.gdpo_reward_keys:
        return [
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward function's returned "
            "dict that hold the reward dimensions (e.g. [acc, format_reward])"
        ]
    weights = a.gdpo_reward_weights
    if weights is not None and len(weights) != len(a.gdpo_reward_keys):
        return [
            f"algorithm.gdpo_reward_weights has {len(weights)} values for {len(a.gdpo_reward_keys)} "
            "algorithm.gdpo_reward_keys: give one weight per key, or null for 1 each"
        ]
    return []


def _multi_turn_problems(r: RolloutConfig) -> list[str]:
    """Multi-turn rollout against the rest of the config (it combines with partial rollout, async mode and routing
    replay as single-turn rollout does: their own rules apply)."""
    mt = r.multi_turn
    if mt.enable and not mt.tool_config_path:
        return ["rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path (a tool YAML)"]
    return []


def _async_problems(t: TrainerConfig, pl: PlacementConfig, a: ActorConfig) -> list[str]:
    """trainer.mode=async against the placement and the features it does not carry."""
    ranks = pl.rollout_ranks
    if t.mode == "sync":
        if ranks:
            return [
                f"placement.rollout_ranks={ranks} with trainer.mode=sync: every rank generates and trains in "
                "synchronous mode; set trainer.mode=async to give ranks to rollout, or placement.rollout_ranks=0"
            ]
        return []
    problems = []
    if ranks < 1:
        problems.append(
            "trainer.mode=async needs placement.rollout_ranks >= 1 (the last ranks of the job that only generate)"
        )
    if a.router_replay == "rollout":
        problems.append("trainer.mode=async with actor.router_replay=rollout: routing replay is synchronous only")
    return problems


def _off_policy_problems(
    a: ActorConfig, r: RolloutConfig, al: AlgorithmConfig, t: TrainerConfig, d: DataConfig
) -> list[str]:
    """Partial rollout and the off-policy correction against the rest of the config."""
    problems = []
    pr, mode = r.partial_rollout, al.off_policy.mode
    if pr.enable and a.router_replay == "rollout":
        problems.append(
            "rollout.partial_rollout.enable=true with actor.router_replay=rollout: the routing of a response's earlier "
            "segments is not kept across steps; set one of them off"
        )
    if mode == "auto" and (pr.enable or t.mode == "async"):
        mode = "auto (decoupled with partial rollout or async)"
    if mode not in ("auto", "none") and al.rollout_is_threshold is not None:
        problems.append(
            f"algorithm.off_policy.mode={mode} with algorithm.rollout_is_threshold="
            f"{al.rollout_is_threshold}: both correct the behaviour/rollout mismatch; keep "
            "algorithm.off_policy (its is_threshold) and set algorithm.rollout_is_threshold to null"
        )
    if a.policy_loss.loss_mode == "bypass_mode" and al.rollout_is_threshold is not None:
        problems.append(
            f"actor.policy_loss.loss_mode=bypass_mode with algorithm.rollout_is_threshold="
            f"{al.rollout_is_threshold}: bypass mode takes the rollout as the old policy and corrects with "
            "actor.policy_loss.rollout_correction.* (the other weights are ignored); set "
            "algorithm.rollout_is_threshold to null"
        )
    if pr.enable and pr.segment_length is not None and pr.segment_length >= d.max_response_length:
        problems.append(
            f"rollout.partial_rollout.segment_length={pr.segment_length} covers the whole "
            f"data.max_response_length={d.max_response_length}: every response would end in one segment; "
            "lower it or leave it null (max_response_length / max_segments)"
        )
    return problems


def algorithm_name_problems(al: AlgorithmConfig, a: ActorConfig) -> list[str]:
    """``algorithm.adv_estimator`` and ``actor.policy_loss`` name registered entries (built-ins, plus those of
    ``algorithm.user_algorithms_file``, which is imported here)."""
    path = al.user_algorithms_file
    try:
        load_user_algorithms(path)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        return [
            f"algorithm.user_algorithms_file={path!r}: {exc}; fix the file or set algorithm.user_algorithms_file "
            "to null"
        ]
    problems = []
    names = ((ADV_ESTIMATORS, al.adv_estimator), (POLICY_LOSSES, a.policy_loss.loss_mode))
    for registry, name in names:
        if name not in registry:
            problems.append(registry.unknown(name))
    return problems


def extra_function_spec(item: Any, where: str) -> tuple[Optional[tuple[str, str, Any]], list[str]]:
    """One ``reward.extra_functions`` entry → ``((path, name, weight), problems)``. The spec is None when the
    entry's shape is wrong; a weight that is not a finite number is a problem returned with the spec (so that the
    file can still be checked)."""
    if not isinstance(item, dict):
        return None, [f"{where}: expected a mapping with keys path, name, weight; got {item!r}"]
    unknown = set(item) - {"path", "name", "weight"}
    if unknown:
        return None, [f"{where}: unknown keys {sorted(unknown)}; valid keys are path, name, weight"]
    if not item.get("path"):
        return None, [f"{where}: 'path' (a Python file defining the reward function) is required"]
    weight = item.get("weight", 1.0)
    spec = (str(item["path"]), str(item.get("name", "compute_score")), weight)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        return spec, [f"{where}.weight={weight!r}: expected a finite number"]
    return spec, []


def eval_option_problems(
    data_files: Sequence[str],
    n: Optional[int],
    temperature: Optional[float],
    top_p: Optional[float],
    max_response_length: Optional[int],
) -> list[str]:
    """``megatron-dapo eval``'s own options (each sets a config value: ``rollout.val_kwargs.*``,
    ``data.max_response_length``), named as the user typed them."""
    problems = [] if data_files else ["--data: give at least one verl-format parquet/jsonl file"]
    if n is not None and n < 1:
        problems.append(f"--n {n}: expected >= 1 responses per prompt")
    if temperature is not None and temperature < 0:
        problems.append(f"--temperature {temperature}: expected >= 0 (0 = greedy)")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"--top-p {top_p}: expected a value in (0, 1]")
    if max_response_length is not None and max_response_length < 1:
        problems.append(f"--max-response-length {max_response_length}: expected >= 1")
    return problems


def check_eval_options(*args: Any) -> None:
    """``eval_option_problems``, raised as one ``ConfigError``."""
    problems = eval_option_problems(*args)
    if problems:
        raise ConfigError.of(problems)


def required_input_problems(c: CheckpointConfig, d: DataConfig) -> list[str]:
    """What a training run needs and a config for other commands may leave out."""
    problems = []
    if not c.load_dir:
        problems.append("checkpoint.load_dir is required: the converter's output (megatron-dapo convert hf-to-mcore)")
    if not d.train_files:
        problems.append("data.train_files is required: one or more parquet/jsonl files of prompts")
    return problems


def _lora_problems(a: ActorConfig, p: ParallelConfig, c: CheckpointConfig) -> list[str]:
    """``actor.lora`` (megatron_dapo/models/lora.py, docs/lora.md)."""
    lo, out = a.lora, _Problems()
    out.need("actor.lora.rank", lo.rank, isinstance(lo.rank, int) and lo.rank >= 0, "an integer >= 0 (0 = off)")
    ok = math.isfinite(lo.alpha) and lo.alpha > 0
    out.need("actor.lora.alpha", lo.alpha, ok, "a finite number > 0 (the update is scaled by alpha / rank)")
    out.in_unit("actor.lora.dropout", lo.dropout)
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    ok = bool(lo.target_modules) and all(t in targets or t == "all-linear" for t in lo.target_modules)
    out.need("actor.lora.target_modules", lo.target_modules, ok, f"a non-empty list of {list(targets)} or [all-linear]")
    tp = p.tensor_model_parallel_size
    if isinstance(lo.rank, int) and lo.rank > 0 and isinstance(tp, int) and tp > 0 and lo.rank % tp:
        out.need(
            "actor.lora.rank",
            lo.rank,
            False,
            f"a multiple of parallel.tensor_model_parallel_size={tp}",
            "A of a column-parallel layer is split along the rank (as Megatron-Bridge's)",
        )
    if isinstance(lo.rank, int) and lo.rank > 0 and c.ref_load_dir:
        out.need(
            "checkpoint.ref_load_dir",
            c.ref_load_dir,
            False,
            "unset with actor.lora (the reference is the base with the adapters off: checkpoint.load_dir)",
        )
    return out


# --------------------------------------------------------------------------------------------------- the rule tables


@dataclass(frozen=True)
class Rule:
    """One rule: ``check`` takes the ``ExperimentConfig`` sections named by ``reads`` (field names, in order) and
    returns its problem lines. A cross-field rule runs only when none of the sections it reads has a range problem
    (its messages assume each value is in range); ``after_ranges=False`` runs it whatever the ranges."""

    check: Callable[..., list[str]]
    reads: tuple[str, ...]
    after_ranges: bool = True


# Each value against its valid range, section by section.
RANGE_RULES: tuple[Rule, ...] = (
    Rule(_model_parallel_ranges, ("model", "parallel")),
    Rule(_checkpoint_data_ranges, ("checkpoint", "data")),
    Rule(_actor_ranges, ("actor",)),
    Rule(_rollout_ranges, ("rollout",)),
    Rule(_algorithm_ranges, ("algorithm",)),
    Rule(reward_value_problems, ("reward",)),
    Rule(_trainer_ranges, ("trainer",)),
    Rule(_lora_problems, ("actor", "parallel", "checkpoint")),
    Rule(_placement_async_ranges, ("placement", "async_")),
)

# Settings that are each valid but cannot work together (each line says how to fix it), and the algorithm names.
CROSS_RULES: tuple[Rule, ...] = (
    Rule(_batch_and_sampling_problems, ("actor", "data", "rollout", "algorithm")),
    Rule(_packing_problems, ("actor", "parallel")),
    Rule(_overlong_problems, ("reward", "data"), after_ranges=False),
    Rule(_step_schedule_problems, ("actor", "trainer")),
    Rule(_off_policy_problems, ("actor", "rollout", "algorithm", "trainer", "data")),
    Rule(_async_problems, ("trainer", "placement", "actor")),
    Rule(_multi_turn_problems, ("rollout",)),
    Rule(_gdpo_problems, ("algorithm",)),
    Rule(algorithm_name_problems, ("algorithm", "actor"), after_ranges=False),
    Rule(distillation_problems, ("distillation",), after_ranges=False),  # after the user file is imported
    Rule(distillation_run_problems, ("distillation", "parallel", "algorithm", "trainer", "rollout")),
    Rule(reward_model_problems, ("reward", "parallel", "trainer"), after_ranges=False),  # its ranges and layouts
    Rule(judge_problems, ("reward", "trainer"), after_ranges=False),  # reward.judge: ranges, template, parser, mode
)


class ConfigProblems(list):
    """``config_problems``' lines; ``out_of_range``: the sections with a value out of range (the rules that read them
    and need them in range were skipped)."""

    def __init__(self, lines: list[str], out_of_range: frozenset[str]) -> None:
        super().__init__(lines)
        self.out_of_range = out_of_range


def config_problems(cfg: ExperimentConfig) -> ConfigProblems:
    """Every rule the config alone decides (``RANGE_RULES``, then ``CROSS_RULES``), each run once, as one list. The
    only file read is ``algorithm.user_algorithms_file`` (imported so that the algorithm names can be checked)."""
    problems: list[str] = []
    out_of_range: set[str] = set()
    for rule in RANGE_RULES:
        found = rule.check(*(getattr(cfg, name) for name in rule.reads))
        if found:
            out_of_range.update(rule.reads)
        problems += found
    for rule in CROSS_RULES:
        if not rule.after_ranges or out_of_range.isdisjoint(rule.reads):
            problems += rule.check(*(getattr(cfg, name) for name in rule.reads))
    return ConfigProblems(problems, frozenset(out_of_range))


def raise_if_any(problems: list[str]) -> None:
    """The config-only gate of ``eval`` and ``export`` (``train`` runs ``plan.resolve``, which includes these rules):
    ``raise_if_any(config_problems(cfg))``, every problem in one ``ConfigError``; none: nothing."""
    if problems:
        raise ConfigError.of(problems)
