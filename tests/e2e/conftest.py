"""The Mixture-of-Experts variant of the tiny demo, made once per test session and converted for the trainer (the
dense demo, ``demo``, is in tests/conftest.py: tests/data reads it too)."""

from __future__ import annotations

import pytest

from megatron_dapo.tasks.demo import prepare
from megatron_dapo.weights.convert import convert_hf_to_mcore


@pytest.fixture(scope="session")
def demo_moe(tmp_path_factory) -> dict:
    """The Mixture-of-Experts variant (tiny Qwen3-MoE, configs/tiny_moe_cpu.yaml)."""
    root = tmp_path_factory.mktemp("demo_moe")
    info = prepare(root, seed=0, train_rows=256, family="qwen3_moe")
    convert_hf_to_mcore(info["hf_model"], root / "mcore")
    info["mcore"] = str(root / "mcore")
    info["root"] = root
    return info
