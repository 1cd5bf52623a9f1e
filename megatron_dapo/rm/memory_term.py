"""The reward model's term in ``config/memory.py``'s model: its frozen weights on one rank, at the layout
``rm/reward_model.build_reward_model`` builds (the actor's TP, one pipeline stage), counted from its config.json."""

from __future__ import annotations

from typing import Optional

from megatron_dapo.config.schema import RewardModelConfig
from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.rm.score_head import reward_head
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import hf_config_dir_of
from megatron_dapo.weights.layout import padded_vocab_size


def reward_model_rank_params(arch: ModelArch, tp: int, make_vocab_size_divisible_by: int) -> int:
    """Parameters one TP rank of the reward model holds: the padded embedding's rows / TP, per layer the norms
    (whole), q/k/v (+ bias) and the output projection / TP, the per-head q/k norms (whole), the gated MLP / TP; the
    final norm and the ``[num_labels, hidden]`` head (whole). No LM head."""
    head = reward_head(arch)
    labels = head.shape[0] if head is not None else 1
    h, hd, ffn = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    split = (q + 2 * kv) * h + q * h + 3 * ffn * h + (q + 2 * kv if arch.qkv_bias else 0)
    whole = 2 * h + (2 * hd if arch.qk_layernorm else 0)
    vocab = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, tp)
    return vocab * h // tp + arch.num_layers * (split // tp + whole) + h + labels * h


def reward_model_arch_of(cfg: RewardModelConfig) -> Optional[ModelArch]:
    """The reward model's architecture from ``cfg.load_dir``'s config.json; None when unset or not readable here
    (``check`` away from the files: the term is then left out)."""
    if not cfg.load_dir:
        return None
    try:
        return model_arch_from_hf(hf_config_dir_of(cfg.load_dir))
    except (CheckpointError, FileNotFoundError):
        return None


def reward_model_bytes(cfg: RewardModelConfig, tp: int, param_bytes: int, make_vocab_size_divisible_by: int) -> float:
    """Device bytes of the reward model's weights on one rank (0 without one, or where its config is not readable)."""
    arch = reward_model_arch_of(cfg)
    if arch is None:
        return 0.0
    return float(reward_model_rank_params(arch, tp, make_vocab_size_divisible_by) * param_bytes)
