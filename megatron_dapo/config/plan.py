"""The run, resolved once: ``resolve(cfg, arch, world_size, platform) -> RunPlan``.

Everything a run derives from its config, the model architecture, the world size and the platform is computed here,
once, after every rule (``rules.py``, ``run_rules.py``) has passed: the parallel layout, the attention
implementation and packed sequences, the rows and micro-batches of each phase, the memory hand-off and vLLM's sleep
level, whether the old-policy forward is skipped, dtype sizes. The trainer, the actor, the engine, ``eval`` and
``check`` read the plan; none of them re-derives a value or changes the config. ``check`` resolves the same plan for
a platform it does not run on (``probe_imports=False``: TransformerEngine is not imported to answer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from megatron_dapo.config.rules import warmup_steps
from megatron_dapo.config.run_rules import (
    resolve_max_num_batched_tokens,
    rollout_layout_problems,
    run_problems,
    side_worlds,
    weight_sync_notes,
)
from megatron_dapo.config.schema import ConfigError, ExperimentConfig
from megatron_dapo.dtypes import dtype_bytes
from megatron_dapo.models.families import ModelArch
from megatron_dapo.platform.base import HandoffDefaults, Platform
from megatron_dapo.weights.layout import padded_vocab_size

__all__ = [
    "BatchPlan",
    "HandoffPlan",
    "RolloutPlan",
    "RunPlan",
    "build_plan",
    "plan_problems",
    "resolve",
    "resolve_handoff_plan",
    "rollout_dtype",
    "rollout_plan",
    "uses_reference",
]


@dataclass(frozen=True)
class HandoffPlan:
    """What leaves the device while vLLM generates: the platform's defaults with the config's explicit choices."""

    params: bool
    grads: bool
    optimizer: bool
    reference: bool
    sleep_level: int
    keep_grad_values: bool


def resolve_handoff_plan(cfg: ExperimentConfig, platform: Platform) -> HandoffPlan:
    """``actor.offload_params/grads/optimizer``, ``ref.offload``, ``rollout.sleep_level``: None = the platform's."""
    d: HandoffDefaults = platform.memory_handoff_defaults()

    def pick(value: Optional[Any], default: Any) -> Any:
        return default if value is None else value

    if cfg.trainer.mode == "async":  # no engine beside the actor: nothing to make room for (what is set still holds)
        d = HandoffDefaults(
            params=False, grads=False, optimizer=False, reference=False, sleep_level=d.sleep_level, grad_values=True
        )
    if cfg.actor.lora.rank and cfg.trainer.mode == "sync":
        # LoRA syncs the base once: the engine must keep it across sleeps (level 2 would discard it, and every step
        # would push the whole base again), as verl does with LoRA. An explicit rollout.sleep_level still holds.
        d = replace(d, sleep_level=1)
    return HandoffPlan(
        params=bool(pick(cfg.actor.offload_params, d.params)),
        grads=bool(pick(cfg.actor.offload_grads, d.grads)),
        optimizer=bool(pick(cfg.actor.offload_optimizer, d.optimizer)),
        reference=bool(pick(cfg.ref.offload, d.reference)),
        sleep_level=int(pick(cfg.rollout.sleep_level, d.sleep_level)),
        keep_grad_values=d.grad_values,
    )


def rollout_dtype(cfg: ExperimentConfig) -> str:
    """``rollout.dtype`` with ``auto`` resolved to ``model.params_dtype`` (fp32 | bf16 | fp16)."""
    return cfg.model.params_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def uses_reference(cfg: ExperimentConfig) -> bool:
    """A KL term (in the loss or in the reward) needs the frozen reference."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


@dataclass(frozen=True)
class BatchPlan:
    """Rows and micro-batches of one training step, per data-parallel rank. With ``actor.use_dynamic_bsz`` the
    micro-batch counts are the most there can be (every sequence full length); shorter sequences pack tighter."""

    gen_batch_size: int  # prompts per generation batch
    trajectories_per_step: int  # data.train_batch_size x rollout.n
    mini_batches_per_step: int
    optimizer_steps_per_step: int  # mini-batches x ppo_epochs
    sequences_per_mini_batch_per_rank: int
    micro_batches_per_mini_batch: int
    log_prob_sequences_per_rank: int  # the whole step's rows: old policy and reference forwards
    log_prob_micro_batches: int
    micro_batch_tokens: int  # the longest update micro-batch (all of its sequences full length)
    log_prob_micro_batch_tokens: int


def batch_plan(cfg: ExperimentConfig, dp_size: int, max_model_len: int) -> BatchPlan:
    a, d, n = cfg.actor, cfg.data, cfg.rollout.n
    per_rank = a.ppo_mini_batch_size * n // dp_size
    step_rows = d.train_batch_size * n // dp_size
    minis = d.train_batch_size // a.ppo_mini_batch_size
    if a.use_dynamic_bsz:
        rows_per_micro = rows_per_lp_micro = max(1, a.ppo_max_token_len_per_gpu // max_model_len)
        tokens = lp_tokens = max(a.ppo_max_token_len_per_gpu, max_model_len)
    else:
        rows_per_micro, rows_per_lp_micro = a.ppo_micro_batch_size_per_gpu, a.log_prob_micro_batch_size_per_gpu
        tokens, lp_tokens = rows_per_micro * max_model_len, rows_per_lp_micro * max_model_len
    return BatchPlan(
        gen_batch_size=d.gen_batch_size or d.train_batch_size,
        trajectories_per_step=d.train_batch_size * n,
        mini_batches_per_step=minis,
        optimizer_steps_per_step=minis * a.ppo_epochs,
        sequences_per_mini_batch_per_rank=per_rank,
        micro_batches_per_mini_batch=-(-per_rank // rows_per_micro),
        log_prob_sequences_per_rank=step_rows,
        log_prob_micro_batches=-(-step_rows // rows_per_lp_micro),
        micro_batch_tokens=tokens,
        log_prob_micro_batch_tokens=lp_tokens,
    )


@dataclass(frozen=True)
class RolloutPlan:
    """The engine's resolved settings (``rollout.*`` with the platform's defaults applied)."""

    tp_size: int
    ep_size: int  # vLLM's expert parallelism inside one engine: 1 (experts split by TP) or tp_size
    dp_size: int  # vLLM replicas: world / rollout TP
    max_model_len: int  # data.max_prompt_length + data.max_response_length
    max_num_batched_tokens: int
    dtype: str  # rollout.dtype, auto resolved to model.params_dtype
    sleeps: bool  # vLLM sleeps between rollouts (the platform's sleep mode and rollout.free_cache_engine)
    sleep_level: int
    per_request_seed: bool
    enforce_eager: bool


def rollout_plan(
    cfg: ExperimentConfig, max_position_embeddings: int, world_size: int, platform: Platform
) -> RolloutPlan:
    """The engine's settings for an engine outside a training run (``eval``, benchmarks): its own rules are checked
    here (``ConfigError``); a training run's ``resolve`` has checked them with everything else."""
    problems = rollout_layout_problems(cfg, world_size, max_position_embeddings, platform=platform)
    if problems:
        raise ConfigError.of(problems)
    return _rollout_plan(cfg, world_size, platform)


def _rollout_plan(cfg: ExperimentConfig, world_size: int, platform: Platform) -> RolloutPlan:
    r = cfg.rollout
    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    return RolloutPlan(
        tp_size=r.tensor_model_parallel_size,
        ep_size=r.expert_parallel_size,
        dp_size=world_size // r.tensor_model_parallel_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=resolve_max_num_batched_tokens(cfg, max_model_len),
        dtype=rollout_dtype(cfg),
        # Disaggregated rollout ranks hold nothing else: their engines never sleep.
        sleeps=bool(platform.supports_vllm_sleep() and r.free_cache_engine and cfg.trainer.mode == "sync"),
        sleep_level=resolve_handoff_plan(cfg, platform).sleep_level,
        per_request_seed=platform.default_per_request_seed if r.per_request_seed is None else bool(r.per_request_seed),
        enforce_eager=platform.default_enforce_eager if r.enforce_eager is None else bool(r.enforce_eager),
    )


@dataclass(frozen=True)
class RunPlan:
    """What a validated run resolves to; built by ``resolve`` only."""

    world_size: int  # the job's ranks
    mode: str  # trainer.mode: "sync" (every rank trains and generates) or "async" (disaggregated)
    train_world: int  # ranks holding the actor: the job's in sync mode, the job's less placement.rollout_ranks in async
    rollout_world: int  # ranks holding vLLM engines: the job's in sync mode, placement.rollout_ranks in async
    platform_name: str
    on_device: bool  # the platform runs on an accelerator (CUDA or NPU)
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    ep: int  # expert parallel (1 for a dense model)
    etp: int  # expert tensor parallel (TP unless set; TP for a dense model)
    dp_size: int  # actor data-parallel size: world / (TP x PP x CP)
    expert_dp_size: int  # world / (ETP x EP x PP): where expert gradients and optimizer shards live
    rollout: RolloutPlan
    padded_vocab_size: int  # the actor's embedding / output rows (make_vocab_size_divisible_by x TP)
    total_steps: Optional[int]  # None: not known yet (set by the data, not by trainer.total_training_steps)
    warmup_steps: Optional[int]  # lr warm-up over total_steps; None when total_steps is
    transformer_impl: str  # model.transformer_impl resolved: "transformer_engine" or "local"
    use_remove_padding: bool  # packed (THD) micro-batches
    # The forward passes an explicit [1, 1, s, s] causal mask (kept on the device, one for the longest s): only
    # megatron-core's DotProductAttention needs one (model.attention_backend=local). TransformerEngine ignores it for a
    # causal layer, MindSpeed's flash attention and the local spec's SDPA core attention derive causality themselves.
    explicit_causal_mask: bool
    handoff: HandoffPlan
    uses_reference: bool
    on_policy_update: bool  # the old-policy forward is skipped: the update's own forward is the old policy
    partial: Optional[PartialPlan]  # partial rollout's segments; None = every response generated whole
    reward_overlap: bool  # each response scored as the engine ends it (reward.overlap_generation, where it applies)
    off_policy_mode: str  # algorithm.off_policy.mode resolved: "decoupled", "tis" or "none"
    is_threshold: Optional[float]  # the IS weight's truncation (is_weight_threshold); None = no weight
    max_staleness: int  # async: versions a group may lag the weights it is trained with
    queue_groups: int  # async: scored groups waiting for the trainer at most (resolved)
    batches: BatchPlan
    params_dtype: str
    param_bytes: int
    rollout_bytes: int
    notes: tuple[str, ...] = ()  # things worth knowing that are not problems (logged by the caller)

    @property
    def rollout_tp_size(self) -> int:
        return self.rollout.tp_size

    @property
    def rollout_dp_size(self) -> int:
        return self.rollout.dp_size

    @property
    def max_model_len(self) -> int:
        return self.rollout.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.rollout.max_num_batched_tokens


def _attention_problems(cfg: ExperimentConfig, platform: Platform, probe_imports: bool) -> tuple[str, list[str]]:
    """(resolved transformer_impl, problems): TransformerEngine importable when it is asked for (``probe_imports``),
    context parallelism supported by the attention, packed sequences only with an attention that takes them."""
    requested = cfg.model.transformer_impl
    impl = platform.default_transformer_impl if requested == "auto" else requested
    problems: list[str] = []
    try:
        if probe_imports:
            impl = platform.resolve_transformer_impl(requested)
        platform.check_context_parallel(cfg.parallel.context_parallel_size, impl)
    except (RuntimeError, ValueError) as exc:
        problems.append(str(exc))
    if cfg.actor.use_remove_padding and impl == "local":
        problems.append(
            "actor.use_remove_padding=true needs packed (THD) attention: model.transformer_impl=transformer_engine "
            "(CUDA) or MindSpeed (Ascend NPU); megatron-core's local spec has none. Set actor.use_remove_padding=false"
        )
    return impl, problems


def plan_problems(
    cfg: ExperimentConfig,
    arch: ModelArch,
    world_size: int,
    platform: Platform,
    total_steps: Optional[int] = None,
    probe_imports: bool = True,
) -> list[str]:
    """Every problem ``resolve`` would raise, as a list (``check`` reports them)."""
    problems = run_problems(cfg, arch, world_size, platform, total_steps)
    return problems + _attention_problems(cfg, platform, probe_imports)[1]


def on_policy_update(cfg: ExperimentConfig) -> bool:
    """One epoch over one mini-batch per step, no KL in the reward: the update's first forward is the old policy, so
    ``actor.old_log_prob_forward=auto`` skips the separate forward (``DAPOTrainer.train_step``)."""
    a = cfg.actor
    return (
        a.old_log_prob_forward == "auto"
        and a.ppo_epochs == 1
        and a.ppo_mini_batch_size == cfg.data.train_batch_size
        and not cfg.algorithm.use_kl_in_reward
    )


@dataclass(frozen=True)
class PartialPlan:
    """Partial rollout resolved (``rollout.partial_rollout``): a response is generated ``segment_length`` tokens per
    step; its ``max_segments``-th segment takes whatever budget is left, so it spans at most that many versions."""

    segment_length: int
    max_segments: int


def partial_plan(cfg: ExperimentConfig) -> Optional[PartialPlan]:
    """None without partial rollout; else the segment length (default: the budget split into ``max_segments``)."""
    pr = cfg.rollout.partial_rollout
    if not pr.enable:
        return None
    budget = cfg.data.max_response_length
    return PartialPlan(pr.segment_length or -(-budget // pr.max_segments), pr.max_segments)


def reward_overlaps_generation(cfg: ExperimentConfig) -> bool:
    """``reward.overlap_generation`` where it applies: scoring in worker processes (the engine keeps this process
    busy) and a rollout of whole responses in the training job (partial rollout and the async rollout ranks score
    the groups a round completes)."""
    whole = partial_plan(cfg) is None and cfg.trainer.mode == "sync"
    return cfg.reward.overlap_generation and cfg.reward.num_workers > 0 and whole


def off_policy_mode(cfg: ExperimentConfig) -> str:
    """``algorithm.off_policy.mode`` with ``auto`` resolved: decoupled where stale tokens can occur (partial
    rollout, asynchronous training), none where every batch is on-policy."""
    mode = cfg.algorithm.off_policy.mode
    if mode != "auto":
        return mode
    return "decoupled" if cfg.rollout.partial_rollout.enable or cfg.trainer.mode == "async" else "none"


def is_weight_threshold(cfg: ExperimentConfig) -> Optional[float]:
    """The truncation of the IS weight proximal / behaviour (algo/off_policy.py), None = no weight: decoupled's
    ``is_threshold``; with ``none`` the synchronous ``algorithm.rollout_is_threshold``; none with ``tis`` (the
    behaviour policy is the old policy there)."""
    mode = off_policy_mode(cfg)
    if mode == "decoupled":
        return float(cfg.algorithm.off_policy.is_threshold)
    return cfg.algorithm.rollout_is_threshold if mode == "none" else None


def resolve(
    cfg: ExperimentConfig,
    arch: ModelArch,
    world_size: int,
    platform: Platform,
    total_steps: Optional[int] = None,
    probe_imports: bool = True,
) -> RunPlan:
    """Check the run (every rule, every problem at once: ``ConfigError``) and resolve it.

    ``total_steps``: the number of training steps when the caller knows it (the trainer: from
    ``trainer.total_training_steps``, else epochs x batches of the training data); None = only
    ``trainer.total_training_steps``, and without it the warm-up is checked when the optimizer is built.
    """
    problems = plan_problems(cfg, arch, world_size, platform, total_steps, probe_imports)
    if problems:
        raise ConfigError.of(problems)
    return build_plan(cfg, arch, world_size, platform, total_steps, probe_imports)


def build_plan(
    cfg: ExperimentConfig,
    arch: ModelArch,
    world_size: int,
    platform: Platform,
    total_steps: Optional[int] = None,
    probe_imports: bool = True,
) -> RunPlan:
    """The ``RunPlan`` without the rules: for ``check``, which reports a config's problems *and* its plan. Needs
    sizes in range and a parallel layout that divides the world (``check`` makes sure of both first)."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, max(1, p.context_parallel_size)
    ep = p.expert_model_parallel_size if arch.is_moe else 1
    etp = (p.expert_tensor_parallel_size or tp) if arch.is_moe else tp
    train_world, rollout_world = side_worlds(cfg, world_size)
    dp = train_world // (tp * pp * cp)
    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    impl = _attention_problems(cfg, platform, probe_imports)[0]
    padded_vocab = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    steps = total_steps if total_steps is not None else cfg.trainer.total_training_steps
    return RunPlan(
        world_size=world_size,
        mode=cfg.trainer.mode,
        train_world=train_world,
        rollout_world=rollout_world,
        platform_name=platform.name,
        on_device=platform.device_type != "cpu",
        tp=tp,
        pp=pp,
        vpp=p.virtual_pipeline_model_parallel_size,
        cp=cp,
        ep=ep,
        etp=etp,
        dp_size=dp,
        expert_dp_size=train_world // (etp * ep * pp),
        rollout=_rollout_plan(cfg, rollout_world, platform),
        padded_vocab_size=padded_vocab,
        total_steps=steps,
        warmup_steps=warmup_steps(cfg.actor.optim, steps) if steps is not None else None,
        transformer_impl=impl,
        use_remove_padding=_remove_padding(cfg, impl),
        explicit_causal_mask=platform.causal_mask_needed and impl == "local" and cfg.model.attention_backend == "local",
        handoff=resolve_handoff_plan(cfg, platform),
        uses_reference=uses_reference(cfg),
        on_policy_update=on_policy_update(cfg),
        partial=partial_plan(cfg),
        reward_overlap=reward_overlaps_generation(cfg),
        off_policy_mode=off_policy_mode(cfg),
        is_threshold=is_weight_threshold(cfg),
        max_staleness=cfg.async_.max_staleness,
        queue_groups=cfg.async_.queue_groups or (cfg.async_.max_staleness + 1) * cfg.data.train_batch_size,
        batches=batch_plan(cfg, dp, max_model_len),
        params_dtype=cfg.model.params_dtype,
        param_bytes=dtype_bytes(cfg.model.params_dtype, "model.params_dtype"),
        rollout_bytes=dtype_bytes(rollout_dtype(cfg), "rollout.dtype"),
        notes=tuple(_notes(cfg, arch, padded_vocab)),
    )


def _remove_padding(cfg: ExperimentConfig, impl: str) -> bool:
    """``actor.use_remove_padding``; None = on where the attention takes packed sequences and CP is 1."""
    if cfg.actor.use_remove_padding is None:
        return impl != "local" and cfg.parallel.context_parallel_size <= 1
    return cfg.actor.use_remove_padding


def _notes(cfg: ExperimentConfig, arch: ModelArch, padded_vocab: int) -> list[str]:
    notes = weight_sync_notes(cfg, arch, padded_vocab)
    p = cfg.parallel
    if p.virtual_pipeline_model_parallel_size is not None and cfg.actor.use_dynamic_bsz:
        notes.append(
            "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
            "interleaved schedule needs the number of micro-batches to be a multiple of PP="
            f"{p.pipeline_model_parallel_size}, which dynamic batching does not guarantee"
        )
    return notes
