"""Shared by the one-process benchmarks (``checkpoint_save.py``, ``sdpa_attention.py``): a Qwen2-shaped model's size
arguments and the torchrun environment of a world of one."""

from __future__ import annotations

import argparse
import os


def add_model_shape_args(ap: argparse.ArgumentParser, layers: int, vocab: int) -> None:
    """``--layers --vocab --hidden --ffn --heads --kv-heads`` (a Qwen2-shaped GPT)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)


def single_process_env() -> None:
    """What torchrun would set for a world of one (one thread, a port of this process's own), unless already set."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
