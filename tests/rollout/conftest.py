"""Fixtures for the rollout tests: tiny HF checkpoints (random weights, made locally)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Tiny but vLLM-CPU compatible: its CPU attention kernels need head_dim >= 32 (head_dim 16 is refused with
# "Unsupported CPU attention configuration"), hence hidden 128 with 4 heads.
TINY = dict(
    vocab_size=128,
    num_layers=2,
    hidden_size=128,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen2 (tied and untied), qwen3, llama (tied), qwen3_moe, qwen2_moe: name -> checkpoint directory."""
    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("rollout_ckpts")
    specs = {
        "qwen2_tied": ("qwen2", True),
        "qwen2": ("qwen2", False),
        "qwen3": ("qwen3", False),
        "llama_tied": ("llama", True),
        "qwen3_moe": ("qwen3_moe", False),
        "qwen2_moe": ("qwen2_moe", False),
    }
    # vllm-cpu pads a fused-MoE layer's per-rank expert FFN to a multiple of 32 and cannot reload padded layers
    # (docs/moe.md), so the MoE checkpoint synced at rollout TP 2 has expert FFN 64.
    extra = {"qwen2_moe": {"moe_intermediate_size": 64}}
    return {
        name: save_tiny_hf_checkpoint(root / name, fam, seed=0, tie_word_embeddings=tied, **TINY, **extra.get(name, {}))
        for name, (fam, tied) in specs.items()
    }
