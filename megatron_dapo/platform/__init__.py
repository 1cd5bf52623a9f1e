"""Platform seam: cpu | cuda | npu. ``get_platform()`` returns the one in use; nothing else branches on hardware."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Optional

import torch

from megatron_dapo.platform.base import Platform
from megatron_dapo.platform.cpu import CpuPlatform
from megatron_dapo.platform.cuda import CudaPlatform
from megatron_dapo.platform.npu import NpuPlatform

_SUPPORTED = ("cpu", "cuda", "npu")
_current: Optional[Platform] = None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  # optional: the [npu] extra; importing it registers torch.npu

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def select_platform_name(
    requested: str = "auto",
    npu_available: Callable[[], bool] = _npu_available,
    cuda_available: Callable[[], bool] = _cuda_available,
) -> str:
    """Resolve ``auto`` to npu > cuda > cpu by what is present; an explicit name is checked, not guessed."""
    if requested not in ("auto",) + _SUPPORTED:
        raise ValueError(f"parallel.platform={requested!r}: expected one of auto, {', '.join(_SUPPORTED)}")
    if requested == "auto":
        if npu_available():
            return "npu"
        if cuda_available():
            return "cuda"
        return "cpu"
    if requested == "cuda" and not cuda_available():
        raise RuntimeError("parallel.platform=cuda but torch.cuda.is_available() is False on this machine")
    if requested == "npu" and not npu_available():
        raise RuntimeError("parallel.platform=npu but torch_npu is not installed or no NPU is visible")
    return requested


def make_platform(name: str) -> Platform:
    if name == "cpu":
        return CpuPlatform()
    if name == "cuda":
        return CudaPlatform()
    if name == "npu":
        return NpuPlatform()
    raise ValueError(f"unknown platform {name!r}; expected one of {', '.join(_SUPPORTED)}")


def init_platform(requested: str = "auto") -> Platform:
    """Pick the platform for this process, apply its patches (once) and remember it."""
    global _current
    name = select_platform_name(requested)
    if _current is not None and _current.name == name:
        return _current
    _current = make_platform(name)
    _current.setup()
    return _current


def use_platform(platform: Platform) -> Platform:
    """Install ``platform`` for this process (set up once): ``init_platform`` then returns it while the config asks
    for its name. Tests use it for a modelled device (``megatron_dapo/testing/device_ledger.py``)."""
    global _current
    platform.setup()
    _current = platform
    return platform


def platform_for(requested: str = "auto") -> Platform:
    """What ``init_platform(requested)`` will return, to ask before it is set up (the run's gate resolves the plan
    before any process group exists): the installed platform when it is that one (``use_platform``'s modelled device
    included), else a new instance that is not set up (nothing patched, nothing of megatron-core imported). An
    explicit name is taken as it is: ``check`` asks a CUDA config's questions on a CPU machine."""
    name = select_platform_name(requested) if requested == "auto" else requested
    if _current is not None and _current.name == name:
        return _current
    return make_platform(name)


def get_platform() -> Platform:
    """The platform chosen by ``init_platform`` (auto-detected on first use)."""
    return _current if _current is not None else init_platform("auto")


__all__ = [
    "Platform",
    "get_platform",
    "init_platform",
    "make_platform",
    "platform_for",
    "select_platform_name",
    "use_platform",
]
