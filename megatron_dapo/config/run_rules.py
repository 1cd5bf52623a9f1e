"""What a training run needs besides the config: the model architecture (``ModelArch`` from the HF
``config.json``), the world size, the platform, the number of training steps and the user's reward files. Pure
functions returning problem lines, each taking the config sections it reads; ``plan.plan_problems`` runs them once
with the config's own rules (``rules.py``): ``plan.resolve`` raises them, ``megatron-dapo check`` reports them.
"""

from __future__ import annotations

from typing import Optional

from megatron_dapo.config.rules import extra_function_spec
from megatron_dapo.config.schema import (
    ActorConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from megatron_dapo.dtypes import dtype_bytes
from megatron_dapo.models.families import ModelArch
from megatron_dapo.platform import Platform, platform_for
from megatron_dapo.reward.custom import load_reward_function

DEFAULT_MIN_BATCHED_TOKENS = 8192
MIB = 2**20


def config_platform(parallel: ParallelConfig) -> Platform:
    """The platform ``parallel.platform`` names, for its answers only (not set up: ``check`` asks a CUDA config's
    questions on a CPU machine); auto = this machine's (detected, not set up: nothing of megatron-core imported)."""
    return platform_for(parallel.platform)


# ----------------------------------------------------------------------------------------------- actor layout


def parallel_layout_problems(
    parallel: ParallelConfig,
    world_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: Optional[int] = None,
    world_desc: str = "",
    num_experts: Optional[int] = None,
    moe_ffn_hidden_size: Optional[int] = None,
) -> list[str]:
    """The actor's TP/PP/VPP sizes against the world and the model (heads, KV heads and FFN ÷ TP, layers ÷ PP×VPP),
    and the expert sizes (``expert_layout_problems``) when ``num_experts`` is given (0: a dense model).

    ``world_desc`` follows "world size N" in the messages (``check`` says how the world size was made up)."""
    p = parallel
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        return [f"parallel.tensor_model_parallel_size={tp} and pipeline_model_parallel_size={pp} must be >= 1"]
    problems = []
    cp = max(1, p.context_parallel_size)
    if world_size % (tp * pp * cp):
        sizes, product = (f"{tp} x {pp}", tp * pp) if cp == 1 else (f"{tp} x {pp} x CP {cp}", tp * pp * cp)
        problems.append(
            f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size = {sizes} = {product} does not "
            f"divide the world size {world_size}{world_desc}; change TP/PP or the number of processes"
        )
    for value, name in (
        (num_attention_heads, "num_attention_heads"),
        (num_query_groups, "num_key_value_heads"),
        (ffn_hidden_size, "intermediate_size"),
    ):
        if value is not None and value % tp:
            what = f"{name}={value}" + (" (query groups)" if name == "num_key_value_heads" else "")
            problems.append(
                f"parallel.tensor_model_parallel_size={tp} does not divide the model's {what}; use a divisor of {value}"
            )
    stages = pp * (vpp or 1)
    if num_layers % stages:
        problems.append(
            f"parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1} = "
            f"{stages} does not divide the model's num_hidden_layers={num_layers}; use sizes whose product divides "
            f"{num_layers}"
        )
    if vpp is not None and pp < 2:
        problems.append(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs parallel.pipeline_model_parallel_size >= 2; "
            "set it to null or raise PP"
        )
    if p.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1; set it to false")
    if num_experts is not None:
        problems += expert_layout_problems(p, world_size, num_experts, moe_ffn_hidden_size, world_desc)
    return problems


def expert_layout_problems(
    parallel: ParallelConfig,
    world_size: int,
    num_experts: int = 0,
    moe_ffn_hidden_size: Optional[int] = None,
    world_desc: str = "",
) -> list[str]:
    """Expert parallelism (EP) and expert tensor parallelism (ETP, default TP) against the world and the model.

    megatron-core's ``initialize_model_parallel`` carves the expert groups out of the same ranks: the world must be a
    multiple of ETP x EP x PP (EP groups come from DP x CP, and from TP too when ETP < TP); experts are split evenly
    over EP and each expert's FFN over ETP. A dense model has no experts to spread: EP and ETP must stay unset."""
    p = parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    if not isinstance(ep, int) or ep < 1 or (etp is not None and (not isinstance(etp, int) or etp < 1)):
        return []  # the range rules report these (rules.RANGE_RULES)
    if not num_experts:
        problems = []
        if ep != 1:
            problems.append(
                f"parallel.expert_model_parallel_size={ep} needs a Mixture-of-Experts model; this model is dense: set "
                "it to 1"
            )
        if etp is not None and etp != p.tensor_model_parallel_size:
            problems.append(
                f"parallel.expert_tensor_parallel_size={etp} needs a Mixture-of-Experts model; this model is dense: "
                "set it to null"
            )
        return problems
    problems = []
    etp_eff = p.tensor_model_parallel_size if etp is None else etp
    pp = p.pipeline_model_parallel_size
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        # megatron-core's TransformerConfig refuses this for training (the MoE dispatcher expects SP-split tokens).
        problems.append(
            f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} with a Mixture-of-Experts model needs "
            "parallel.sequence_parallel=true (megatron-core's rule for MoE with TP)"
        )
    if num_experts % ep:
        problems.append(
            f"parallel.expert_model_parallel_size={ep} does not divide the model's num_experts={num_experts}; use a "
            f"divisor of {num_experts}"
        )
    if world_size % (etp_eff * ep * pp):
        problems.append(
            f"parallel.expert_tensor_parallel_size x expert_model_parallel_size x pipeline_model_parallel_size = "
            f"{etp_eff} x {ep} x {pp} = {etp_eff * ep * pp} does not divide the world size {world_size}{world_desc} "
            "(expert_tensor_parallel_size defaults to tensor_model_parallel_size); change EP/ETP or the number of "
            "processes"
        )
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp_eff:
        problems.append(
            f"parallel.expert_tensor_parallel_size={etp_eff} does not divide the model's "
            f"moe_intermediate_size={moe_ffn_hidden_size}; use a divisor of {moe_ffn_hidden_size}"
        )
    return problems


def batch_layout_problems(
    a: ActorConfig, r: RolloutConfig, d: DataConfig, p: ParallelConfig, dp_size: int
) -> list[str]:
    """Mini-batches against the data-parallel size: each DP rank takes an equal share of every mini-batch, and the
    interleaved (VPP) schedule needs a multiple of PP micro-batches (not checkable with dynamic batch sizes)."""
    n = r.n
    mini_rows = a.ppo_mini_batch_size * n
    if mini_rows % dp_size:
        return [
            f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size} x {n} = {mini_rows} sequences per "
            f"mini-batch is not divisible by the data-parallel size {dp_size} (world / (TP x PP)): each DP rank "
            "takes an equal share; change actor.ppo_mini_batch_size, rollout.n or the layout"
        ]
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is None or a.use_dynamic_bsz:
        return []
    problems = []
    for key, mbs, rows in (
        ("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, mini_rows // dp_size),
        (
            "actor.log_prob_micro_batch_size_per_gpu",
            a.log_prob_micro_batch_size_per_gpu,
            d.train_batch_size * n // dp_size,
        ),
    ):
        m = -(-rows // mbs)
        if m % pp:
            problems.append(
                f"{key}={mbs}: {rows} sequences per rank give {m} micro-batches, not a multiple of "
                f"parallel.pipeline_model_parallel_size={pp} as the interleaved (VPP) schedule needs; choose a "
                "micro-batch size that gives a multiple"
            )
    return problems


# ----------------------------------------------------------------------------------------------- rollout layout


def rollout_layout_problems(
    r: RolloutConfig,
    d: DataConfig,
    world_size: int,
    max_position_embeddings: int,
    arch: Optional[ModelArch] = None,
    world_desc: str = "",
    platform: Optional[Platform] = None,
) -> list[str]:
    """Rollout TP against the world (and, given the arch, the heads / KV heads / FFN vLLM splits), and the
    sequence budget against ``max_position_embeddings`` and ``rollout.max_num_batched_tokens``. ``platform``: the
    one whose fused-MoE kernel the engine runs (None = this machine's)."""
    tp = r.tensor_model_parallel_size
    problems = []
    if tp < 1 or world_size % tp:
        problems.append(
            f"rollout.tensor_model_parallel_size={tp} must be >= 1 and divide the world size {world_size}{world_desc}"
            f" (each group of {tp} consecutive ranks forms one vLLM replica); use a divisor of {world_size}"
        )
    ep = r.expert_parallel_size
    if ep > 1 and ep != tp:
        problems.append(
            f"rollout.expert_parallel_size={ep} must be 1 or equal rollout.tensor_model_parallel_size={tp}: vLLM's "
            "expert parallelism spans one engine's ranks (EP = TP x DP, one TP group per engine here)"
        )
    if arch is not None and tp >= 1:
        heads, groups, ffn = arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size
        if heads % tp:
            problems.append(
                f"rollout.tensor_model_parallel_size={tp} does not divide num_attention_heads={heads} (vLLM splits "
                f"the heads); use a divisor of {heads}"
            )
        if (groups % tp) if tp <= groups else (tp % groups):
            problems.append(
                f"rollout.tensor_model_parallel_size={tp} and num_key_value_heads={groups}: vLLM needs one to divide "
                "the other (it splits the KV heads, or replicates them when TP is larger)"
            )
        if ffn % tp:
            problems.append(
                f"rollout.tensor_model_parallel_size={tp} does not divide intermediate_size={ffn}; use a divisor"
            )
        if arch.is_moe:
            problems += _rollout_expert_problems(tp, ep, arch, platform or config_platform(ParallelConfig()))
        elif ep > 1:
            problems.append(f"rollout.expert_parallel_size={ep} needs a mixture-of-experts model; set it to 1")
    prompt, response = d.max_prompt_length, d.max_response_length
    if prompt < 1 or response < 1:
        return problems + [f"data.max_prompt_length={prompt} and data.max_response_length={response} must both be >= 1"]
    budget = prompt + response
    if budget > max_position_embeddings:
        problems.append(
            f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {budget} exceeds"
            f" the model's max_position_embeddings={max_position_embeddings}; shorten one of them"
        )
    batched = r.max_num_batched_tokens
    if batched is not None and batched < budget:
        problems.append(
            f"rollout.max_num_batched_tokens={batched} must be >= data.max_prompt_length + data.max_response_length"
            f" = {budget} (chunked prefill is disabled, so a whole prompt must fit in one engine step); set it to at"
            f" least {budget} (or null)"
        )
    return problems


def _rollout_expert_problems(tp: int, ep: int, arch: ModelArch, platform: Platform) -> list[str]:
    """Without engine EP vLLM splits each expert's FFN over rollout TP, with it each rank holds E/EP whole experts;
    the platform's fused-MoE kernel may need an aligned FFN share (``check`` passes the config's platform: it runs
    for a CUDA config on a CPU machine)."""
    expert_ffn = arch.moe_ffn_hidden_size
    if ep > 1:
        if arch.num_experts % ep:
            return [
                f"rollout.expert_parallel_size={ep} does not divide num_experts={arch.num_experts} (each engine rank "
                "holds an equal block of experts); use a divisor"
            ]
        tp = 1  # whole experts: the FFN is not split
    if expert_ffn % tp:
        return [
            f"rollout.tensor_model_parallel_size={tp} does not divide moe_intermediate_size={expert_ffn} (vLLM splits "
            "each expert's FFN); use a divisor"
        ]
    align = platform.vllm_moe_ffn_alignment
    if ep > 1 and expert_ffn % align:
        return [
            f"moe_intermediate_size={expert_ffn} is not a multiple of {align}: the engine's fused-MoE kernel on the "
            f"{platform.name} platform pads it, and vLLM cannot reload weights into a padded layer"
        ]
    if (expert_ffn // tp) % align:
        return [
            f"moe_intermediate_size={expert_ffn} / rollout.tensor_model_parallel_size={tp} = {expert_ffn // tp} is not "
            f"a multiple of {align}: the engine's fused-MoE kernel on the {platform.name} platform pads it, and "
            "vLLM cannot reload weights into a padded layer; choose a rollout TP that keeps it a multiple"
        ]
    return []


def gated_delta_net_rollout_problems(arch: ModelArch, dtype: str, platform: Platform) -> list[str]:
    """The rollout dtype ``dtype`` (``rollout.dtype``, ``auto`` resolved) against the dtypes the platform's vLLM runs
    Gated DeltaNet layers in (``Platform.vllm_gated_delta_net_dtypes``)."""
    allowed = platform.vllm_gated_delta_net_dtypes
    if arch.gated_delta_net is None or allowed is None or dtype in allowed:
        return []
    return [
        f"rollout.dtype resolves to {dtype}, but vLLM on the {platform.name} platform runs the Gated DeltaNet layers "
        f"of {arch.family.name} in {' or '.join(allowed)} only; set rollout.dtype={allowed[0]} (the actor keeps "
        "model.params_dtype)"
    ]


def resolve_max_num_batched_tokens(r: RolloutConfig, max_model_len: int) -> int:
    """``rollout.max_num_batched_tokens``, or (null) ``max(max_model_len, min(8192, max_num_seqs × max_model_len))``."""
    fill = min(DEFAULT_MIN_BATCHED_TOKENS, r.max_num_seqs * max_model_len)
    return r.max_num_batched_tokens or max(max_model_len, fill)


# ----------------------------------------------------------------------------------------------- reward functions


def reward_function_problems(rw: RewardConfig) -> list[str]:
    """The reward functions the config names: every file importable and defining its function (imported here, once
    per process, as the reward manager will). A malformed ``reward.extra_functions`` entry is not imported: the
    reward section's range rule (``rules.reward_value_problems``) reports it."""
    specs: list[tuple[str, str, str]] = []  # (config key, path, name)
    problems: list[str] = []
    cf = rw.custom_function
    if cf.path:
        specs.append(("reward.custom_function", cf.path, cf.name))
    for i, item in enumerate(rw.extra_functions):
        where = f"reward.extra_functions[{i}]"
        spec = extra_function_spec(item, where)[0]
        if spec is not None:
            specs.append((where, spec[0], spec[1]))
    for key, path, name in specs:
        try:
            load_reward_function(path, name)
        except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
            problems.append(f"{key}.path={path!r}, {key}.name={name!r}: {exc}")
    return problems


# ----------------------------------------------------------------------------------------------- weight sync


def weight_sync_notes(m: ModelConfig, r: RolloutConfig, arch: ModelArch, padded_vocab: int) -> list[str]:
    """The sync puts a module larger than ``rollout.weight_sync_bucket_mb`` in a bucket of its own
    (``rollout/sync.py``): not an error, but the sync's peak is then that module, not the bucket size."""
    param_bytes = dtype_bytes(m.params_dtype)
    h = arch.hidden_size
    modules = {
        "the embedding (padded vocabulary x hidden)": padded_vocab * h,
        "linear_fc1 (gate + up)": 2 * arch.ffn_hidden_size * h,
        "linear_qkv": (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim * h,
    }
    if arch.is_moe:
        # vLLM takes all experts of a layer in one update (rollout/sync.py): fc1 (gate + up) and fc2 of every expert
        modules["the routed experts of one MoE layer"] = arch.num_experts * 3 * arch.moe_ffn_hidden_size * h
    name, numel = max(modules.items(), key=lambda kv: kv[1])
    size_mb = numel * param_bytes / MIB
    bucket_mb = r.weight_sync_bucket_mb
    if size_mb <= bucket_mb:
        return []
    return [
        f"rollout.weight_sync_bucket_mb={bucket_mb} is smaller than the largest module, {name}: {size_mb:.0f} MiB in "
        f"{m.params_dtype}; it is synced in a bucket of its own, so a weight sync holds up to "
        f"{size_mb:.0f} MiB of full tensors at once"
    ]


# ----------------------------------------------------------------------------------------------- the whole run


def side_worlds(t: TrainerConfig, pl: PlacementConfig, world_size: int) -> tuple[int, int]:
    """(ranks that train, ranks that generate): all of them both in sync mode; split by ``placement.rollout_ranks``
    in async mode (the last ranks generate)."""
    if t.mode != "async":
        return world_size, world_size
    return world_size - pl.rollout_ranks, pl.rollout_ranks


def placement_problems(t: TrainerConfig, pl: PlacementConfig, world_size: int) -> list[str]:
    """trainer.mode=async: the placement leaves ranks to both sides."""
    ranks = pl.rollout_ranks
    if t.mode != "async" or 1 <= ranks < world_size:
        return []
    return [
        f"placement.rollout_ranks={ranks} with a job of {world_size} ranks: async mode needs at least one rank on each "
        f"side; use 1 to {world_size - 1} rollout ranks, or launch more processes"
    ]


def layout_sizes_usable(p: ParallelConfig, a: ActorConfig, r: RolloutConfig, d: DataConfig) -> bool:
    """The sizes the layout, batch and memory arithmetic divide by are in range (else those rules are skipped: the
    range rules report the bad values)."""
    positive = [
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        r.tensor_model_parallel_size,
        r.n,
        d.max_prompt_length,
        d.max_response_length,
        d.train_batch_size,
        a.ppo_mini_batch_size,
        a.ppo_micro_batch_size_per_gpu,
        a.log_prob_micro_batch_size_per_gpu,
        a.ppo_max_token_len_per_gpu,
        a.ppo_epochs,
        r.kv_cache_memory_mb,
    ]
    optional = [p.virtual_pipeline_model_parallel_size, d.gen_batch_size]
    return (
        all(v >= 1 for v in positive)
        and all(v is None or v >= 1 for v in optional)
        and 0 < r.gpu_memory_utilization <= 1
        and d.train_batch_size % a.ppo_mini_batch_size == 0
    )


def router_replay_problems(a: ActorConfig, arch: ModelArch, platform: Platform) -> list[str]:
    """``actor.router_replay=rollout`` replays the rollout's expert choices: it needs MoE layers to replay, and an
    engine that returns its routing (the platform says whether its vLLM can: ``Platform.routed_experts_problem``)."""
    if a.router_replay != "rollout":
        return []
    if not arch.is_moe:
        return [
            "actor.router_replay=rollout replays the rollout's MoE routing, but the model is dense (num_experts=0); "
            "set actor.router_replay=none"
        ]
    problem = platform.routed_experts_problem()
    return [problem] if problem else []


def validate_parallel_layout(
    parallel: ParallelConfig,
    world_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
) -> int:
    """Check that the parallel sizes fit the world and the model; returns the data-parallel size.

    Kept for callers that have no ``ModelArch`` (``tools/checkpoint_convert/verify.py``); a training run uses
    ``plan.resolve``, which makes these checks and every other one."""
    problems = parallel_layout_problems(parallel, world_size, num_layers, num_attention_heads, num_query_groups)
    if problems:
        raise ConfigError.of(problems)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    return world_size // (tp * pp)
