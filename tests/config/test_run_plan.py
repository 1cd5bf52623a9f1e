"""``config/plan.resolve``: what a run derives, resolved once into a frozen ``RunPlan`` — micro-batch counts per phase,
the attention implementation and packed sequences, the memory hand-off and sleep level per platform, the on-policy
decision, dtype sizes — without touching the config. Numbers are worked by hand in the comments."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config, to_dict
from megatron_dapo.config.plan import RunPlan, plan_problems, resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from tests.config.test_run_validation import TINY, TINY_HF
from tests.helpers.hf_configs import QWEN3_8B

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # tiny_cpu.yaml names its reward function relative to the repository root


def tiny_plan(overrides=(), world: int = 2, platform: str = "cpu", hf=None) -> RunPlan:
    cfg = load_config(TINY, list(overrides))
    return resolve(cfg, model_arch_from_hf(hf or TINY_HF), world, make_platform(platform), probe_imports=False)


def test_plan_is_frozen_and_leaves_the_config_alone():
    cfg = load_config(TINY, [])
    before = to_dict(cfg)
    plan = resolve(cfg, model_arch_from_hf(TINY_HF), 2, make_platform("cpu"))
    assert to_dict(cfg) == before  # use_remove_padding stays null in the config; the plan holds the resolved value
    assert cfg.actor.use_remove_padding is None and plan.use_remove_padding is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp_size = 4  # type: ignore[misc]


def test_batches_per_phase():
    # tiny_cpu.yaml: train_batch_size 16 prompts x n 32 = 512 trajectories; mini-batch 16 prompts = 512 sequences,
    # DP 2 → 256 per rank; micro-batches of 64 → 4; log-prob micro-batches of 64 over the step's 256 rows → 4.
    b = tiny_plan().batches
    assert (b.gen_batch_size, b.trajectories_per_step) == (24, 512)
    assert (b.mini_batches_per_step, b.optimizer_steps_per_step) == (1, 1)
    assert (b.sequences_per_mini_batch_per_rank, b.micro_batches_per_mini_batch) == (256, 4)
    assert (b.log_prob_sequences_per_rank, b.log_prob_micro_batches) == (256, 4)
    assert b.micro_batch_tokens == 64 * 28  # 64 sequences x (24 prompt + 4 response)
    # Dynamic batch size: 100 tokens hold 3 sequences of 28 → ceil(256 / 3) = 86 micro-batches at most.
    dyn = tiny_plan(["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"]).batches
    assert (dyn.micro_batches_per_mini_batch, dyn.log_prob_micro_batches, dyn.micro_batch_tokens) == (86, 86, 100)
    # Two mini-batches of 8 prompts, two epochs: 4 optimizer steps, 128 sequences per rank in 2 micro-batches.
    two = tiny_plan(["actor.ppo_mini_batch_size=8", "actor.ppo_epochs=2"]).batches
    assert (two.mini_batches_per_step, two.optimizer_steps_per_step) == (2, 4)
    assert (two.sequences_per_mini_batch_per_rank, two.micro_batches_per_mini_batch) == (128, 2)


def test_on_policy_decision():
    assert tiny_plan().on_policy_update  # one epoch over one mini-batch, no KL in the reward
    assert not tiny_plan(["actor.ppo_epochs=2"]).on_policy_update
    assert not tiny_plan(["actor.ppo_mini_batch_size=8"]).on_policy_update
    assert not tiny_plan(["actor.old_log_prob_forward=always"]).on_policy_update
    assert not tiny_plan(["algorithm.use_kl_in_reward=true"]).on_policy_update
    assert tiny_plan(["actor.use_kl_loss=true"]).uses_reference


def test_reward_overlap_where_it_applies():
    # tiny_cpu.yaml scores in-process (reward.num_workers=0): nothing to overlap with, the engine holds this process.
    assert not tiny_plan().reward_overlap
    assert tiny_plan(["reward.num_workers=2"]).reward_overlap
    assert not tiny_plan(["reward.num_workers=2", "reward.overlap_generation=false"]).reward_overlap
    # Partial rollout and the async rollout ranks score the groups a round completes.
    assert not tiny_plan(["reward.num_workers=2", "rollout.partial_rollout.enable=true"]).reward_overlap
    asynchronous = ["reward.num_workers=2", "trainer.mode=async", "placement.rollout_ranks=1"]
    assert not tiny_plan(asynchronous).reward_overlap


def test_platform_defaults_resolved_per_platform():
    cpu, cuda = tiny_plan(), tiny_plan(platform="cuda")
    # CPU: nothing leaves the device, vLLM never sleeps; CUDA: verl's hand-off, level-2 sleep, TE attention.
    assert (cpu.handoff.grads, cpu.handoff.optimizer, cpu.rollout.sleeps) == (False, False, False)
    assert (cuda.handoff.grads, cuda.handoff.optimizer, cuda.rollout.sleeps) == (True, True, True)
    assert cuda.handoff.sleep_level == cuda.rollout.sleep_level == 2
    assert (cpu.transformer_impl, cuda.transformer_impl) == ("local", "transformer_engine")
    assert (cpu.use_remove_padding, cuda.use_remove_padding) == (False, True)  # packed where the attention takes it
    assert (cpu.on_device, cuda.on_device) == (False, True)
    assert (cpu.rollout.per_request_seed, cpu.rollout.enforce_eager) == (True, True)
    explicit = tiny_plan(["actor.offload_grads=false", "rollout.sleep_level=1"], platform="cuda")
    assert (explicit.handoff.grads, explicit.rollout.sleep_level) == (False, 1)
    # LoRA pushes the base once: vLLM must keep it while asleep (level 1), unless the config says otherwise.
    assert tiny_plan(["actor.lora.rank=8"], platform="cuda").rollout.sleep_level == 1
    assert tiny_plan(["actor.lora.rank=8", "rollout.sleep_level=2"], platform="cuda").rollout.sleep_level == 2


def test_dtype_sizes_and_rollout_sizes():
    plan = tiny_plan(["model.params_dtype=bf16"])
    assert (plan.params_dtype, plan.param_bytes, plan.rollout.dtype, plan.rollout_bytes) == ("bf16", 2, "bf16", 2)
    plan = tiny_plan(["rollout.dtype=fp16"])
    assert (plan.param_bytes, plan.rollout.dtype, plan.rollout_bytes) == (4, "fp16", 2)
    assert (plan.rollout.dp_size, plan.rollout.max_model_len, plan.rollout.max_num_batched_tokens) == (2, 28, 8192)


def test_attention_rules_are_problems_not_builder_errors():
    problems = plan_problems(
        load_config(TINY, ["actor.use_remove_padding=true"]),
        model_arch_from_hf(TINY_HF),
        2,
        make_platform("cpu"),
    )
    assert any(p.startswith("actor.use_remove_padding=true needs packed (THD) attention") for p in problems)
    with pytest.raises(ConfigError, match="context_parallel_size=2 on platform 'cpu'"):
        tiny_plan(["parallel.context_parallel_size=2"])


def test_context_parallel_counts_in_the_data_parallel_size():
    # 8 GPUs, TP 2 x CP 2 → DP 2 (megatron-core's data-parallel group excludes the CP ranks).
    cfg = load_config(
        REPO / "configs" / "grpo_qwen3_8b.yaml",
        ["parallel.context_parallel_size=2", "actor.use_remove_padding=false", "parallel.sequence_parallel=true"],
    )
    plan = resolve(cfg, model_arch_from_hf(QWEN3_8B), 8, make_platform("cuda"), total_steps=10, probe_imports=False)
    assert (plan.tp, plan.cp, plan.dp_size) == (2, 2, 2)
