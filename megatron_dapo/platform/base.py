"""The platform interface: everything that differs between CPU, CUDA and Ascend NPU lives behind it."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class Platform:
    """Base platform. Subclasses override what differs; the rest of the code only calls these methods."""

    name: str = "base"
    dist_backend: str = "gloo"
    device_type: str = "cpu"
    # vLLM package that implements this platform's engine (for messages only).
    vllm_package: str = "vllm"

    # ----- process start-up
    def setup(self) -> None:
        """Apply platform patches before any megatron-core model code runs. Idempotent."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local accelerator."""

    # ----- megatron-core
    def use_transformer_engine(self) -> bool:
        return False

    def seed(self, seed: int) -> None:
        """Seed the default generator and megatron-core's tensor-parallel RNG tracker (call after parallel init)."""
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def rng_state(self) -> dict[str, Any]:
        """Every generator this rank owns, for checkpoints."""
        import random

        import numpy as np
        from megatron.core import tensor_parallel

        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        }

    def set_rng_state(self, state: dict[str, Any]) -> None:
        import random

        import numpy as np
        from megatron.core import tensor_parallel

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))

    # ----- runtime
    def synchronize(self) -> None:
        """Wait for queued device work (timing)."""

    def empty_cache(self) -> None:
        """Return cached device memory to the allocator/driver between phases."""

    def max_memory_allocated_gb(self) -> float:
        return 0.0

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    # ----- vLLM
    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        """Extra ``vllm.LLM`` kwargs this platform needs."""
        return {"gpu_memory_utilization": gpu_memory_utilization}

    def supports_vllm_sleep(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.dist_backend!r})"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
