"""NVIDIA GPUs: NCCL, TransformerEngine layer spec when TE imports, vllm."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from megatron_dapo.platform.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    device_type = "cuda"
    vllm_package = "vllm"

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def use_transformer_engine(self) -> bool:
        return importlib.util.find_spec("transformer_engine") is not None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def max_memory_allocated_gb(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
