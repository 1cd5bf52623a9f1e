"""The one table of floating-point dtype names: config names (``fp32``/``bf16``/``fp16``, as in
``model.params_dtype``, ``rollout.dtype`` and the converter's ``--dtype``) and HF/vLLM names (``torch_dtype`` in an HF
``config.json``, vLLM's ``dtype=``). File-format codes (safetensors ``F32``...) stay with their format's reader."""

from __future__ import annotations

import torch

__all__ = ["CONFIG_NAMES", "config_name", "dtype_bytes", "from_config_name", "hf_name"]

_BY_CONFIG_NAME: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CONFIG_NAMES: tuple[str, ...] = tuple(sorted(_BY_CONFIG_NAME))


def from_config_name(name: str, key: str = "dtype") -> torch.dtype:
    """``fp32``/``bf16``/``fp16`` → torch dtype; ``key`` names the setting in the error."""
    if name not in _BY_CONFIG_NAME:
        raise ValueError(f"{key}={name!r}: expected one of {', '.join(CONFIG_NAMES)}")
    return _BY_CONFIG_NAME[name]


def dtype_bytes(name: str, key: str = "dtype") -> int:
    """Bytes per element of a config dtype name (``fp32`` 4, ``bf16``/``fp16`` 2)."""
    return from_config_name(name, key).itemsize


def config_name(dtype: torch.dtype) -> str:
    for name, dt in _BY_CONFIG_NAME.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no config name (expected one of {', '.join(map(str, _HF_NAMES))})")


def hf_name(dtype: torch.dtype) -> str:
    """torch dtype → the name HF configs and vLLM use (``float32``/``bfloat16``/``float16``)."""
    if dtype not in _HF_NAMES:
        raise ValueError(f"dtype {dtype} has no HF name (expected one of {', '.join(map(str, _HF_NAMES))})")
    return _HF_NAMES[dtype]
