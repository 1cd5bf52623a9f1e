"""A LoRA run's checkpoint entries: the ``lora`` component (``training/run_state.LoraBase``: the pointer to the base
and the adapters' shape) refuses another base or another adapter shape, and a LoRA checkpoint and a full one each
refuse the other kind of model (``checkpointing/checkpoint._check_lora_kind``), each with a message naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.checkpointing.checkpoint import _check_lora_kind
from megatron_dapo.config import load_config
from megatron_dapo.training.run_state import LoraBase
from megatron_dapo.weights.checkpoint_errors import CheckpointError

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def lora_cfg(tmp_path: Path, *overrides: str):
    return load_config(TINY, [f"checkpoint.load_dir={tmp_path / 'base'}", "actor.lora.rank=8", *overrides])


def lora_base(cfg) -> LoraBase:
    return LoraBase(cfg.checkpoint.load_dir, cfg.actor.lora)


def test_lora_entry_points_at_the_base_and_round_trips(tmp_path):
    saved = lora_base(lora_cfg(tmp_path)).state_dict()
    assert saved == {
        "base_checkpoint": str(tmp_path / "base"),
        "rank": 8,
        "alpha": 32.0,
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "dropout": 0.0,
        "dropout_position": "pre",
    }
    lora_base(lora_cfg(tmp_path, "actor.lora.alpha=16")).load_state_dict(saved)  # alpha may change (a scale)


def test_lora_entry_refuses_another_base_or_shape(tmp_path):
    saved = lora_base(lora_cfg(tmp_path)).state_dict()
    other = load_config(TINY, [f"checkpoint.load_dir={tmp_path / 'other'}", "actor.lora.rank=8"])
    with pytest.raises(CheckpointError, match=r"trained on base .*base, but this run's checkpoint.load_dir is .*other"):
        lora_base(other).load_state_dict(saved)
    with pytest.raises(CheckpointError, match=r"rank 8 -> 16"):
        lora_base(lora_cfg(tmp_path, "actor.lora.rank=16")).load_state_dict(saved)
    with pytest.raises(CheckpointError, match=r"target_modules"):
        lora_base(lora_cfg(tmp_path, "actor.lora.target_modules=[linear_qkv]")).load_state_dict(saved)


def test_checkpoint_kind_must_match_the_model(tmp_path):
    lora_state = {"adapters_only": True, "lora": {"base_checkpoint": "/b"}}
    _check_lora_kind(tmp_path, lora_state, model_has_adapters=True)
    _check_lora_kind(tmp_path, {"adapters_only": False}, model_has_adapters=False)
    _check_lora_kind(tmp_path, {}, model_has_adapters=False)  # saved before the entry existed: a full model
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only .*export --lora merged"):
        _check_lora_kind(tmp_path, lora_state, model_has_adapters=False)
    with pytest.raises(CheckpointError, match=r"holds a full model, but this run has actor.lora on"):
        _check_lora_kind(tmp_path, {"adapters_only": False}, model_has_adapters=True)
