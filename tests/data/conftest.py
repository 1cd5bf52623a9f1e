"""Fixtures shared by the data tests."""

from __future__ import annotations

import pytest

from megatron_dapo.testing.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny ChatML tokenizer, built once per session (it is deterministic)."""
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))
