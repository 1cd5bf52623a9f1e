"""Fixtures for the checkpoint converter tests: tiny HF checkpoints made locally with random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint

# family, tie_word_embeddings — the round-trip cases of the brief (qwen2 tied and untied, qwen3, llama).
CASES = [("qwen2", True), ("qwen2", False), ("qwen3", False), ("llama", False)]


def load_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, read with the safetensors library (independent of our reader)."""
    out: dict[str, torch.Tensor] = {}
    files = sorted(Path(directory).glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    for f in files:
        part = load_file(str(f))
        assert not set(part) & set(out), f"tensor stored twice: {set(part) & set(out)}"
        out.update(part)
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    assert not only_a and not only_b, f"names differ: only in first {only_a}, only in second {only_b}"
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{name}: {a[name].dtype} vs {b[name].dtype}"
        assert torch.equal(a[name], b[name]), f"{name}: values differ (max |d| {(a[name] - b[name]).abs().max()})"


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_hf(family, tie=False, shard=None, seed=0)`` → directory of a tiny HF checkpoint (made once per args)."""
    cache: dict[tuple, Path] = {}

    def make(family: str, tie: bool = False, shard: str | None = None, seed: int = 0) -> Path:
        key = (family, tie, shard, seed)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"hf_{family}_{'tied' if tie else 'untied'}_{shard or 'single'}_{seed}")
            cache[key] = save_tiny_hf_checkpoint(d, family, seed=seed, max_shard_size=shard, tie_word_embeddings=tie)
        return cache[key]

    return make
