"""Tiny HF checkpoints with random (seeded) weights, made locally: test fixtures and the embedded demo's model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

FAMILY_KWARGS = {
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    # Layer 0 dense (intermediate_size), layers 1-3 MoE: 8 experts, top-2, renormalised, expert FFN 32.
    "qwen3_moe": {
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    # Qwen2-MoE: q/k/v bias, a shared expert (intermediate 48) behind a sigmoid gate; no renormalisation of top-k.
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    # Qwen3-Next: its own defaults (the hybrid's sizes come from the caller; the demo's in megatron_dapo/tasks/demo.py).
    "qwen3_next": {},
    # Qwen3.5-MoE, as its checkpoints come: a VLM, this text model under text_config beside a one-block vision tower
    # (TINY_VISION; the hybrid's sizes come from the caller, as for Qwen3-Next).
    "qwen3_5_moe": {},
    "llama": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        }
    },
}


TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}


def tiny_hf_config(
    family: str,
    vocab_size: int = 100,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
    **extra,
):
    """A ``transformers`` config object of ``family`` (qwen2 | qwen3 | llama | qwen3_moe | qwen2_moe | qwen3_next |
    qwen3_5_moe)."""
    # heavy: transformers
    from transformers import (
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3_5MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    cls = {
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "llama": LlamaConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_next": Qwen3NextConfig,
        "qwen3_5_moe": Qwen3_5MoeConfig,
    }[family]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    kwargs.update(FAMILY_KWARGS[family])
    kwargs.update(extra)
    if family == "qwen3_5_moe":
        kwargs.pop("intermediate_size")  # every layer is MoE
        vision = dict(TINY_VISION, out_hidden_size=hidden_size)
        return cls(text_config=kwargs, vision_config=vision, tie_word_embeddings=tie_word_embeddings)
    return cls(**kwargs)


def make_tiny_hf_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised ``*ForCausalLM`` (eval mode; Qwen3.5-MoE: its VLM class). MoE routers get std 0.5
    (instead of the default 0.02, which routes nearly at random by tiny margins) so that every expert gets tokens and
    the top-k choice is not decided by rounding; expert weights std 0.1."""
    # heavy: transformers
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    config = tiny_hf_config(family, **config_kwargs)
    if family == "qwen3_5_moe":
        model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random non-unit norms so that a wrong norm mapping shows up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight") and "experts" not in name:
                p.normal_(0.0, 0.5)
            elif ".mlp.experts." in name:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_tiny_hf_checkpoint(
    save_dir: str | Path,
    family: str,
    seed: int = 0,
    max_shard_size: Optional[str] = None,
    tokenizer=None,
    **config_kwargs,
) -> Path:
    """Write a tiny checkpoint (safetensors, optionally sharded with an index) and return its directory."""
    save_dir = Path(save_dir)
    model = make_tiny_hf_model(family, seed=seed, **config_kwargs)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(save_dir, safe_serialization=True, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_dir)
    return save_dir
