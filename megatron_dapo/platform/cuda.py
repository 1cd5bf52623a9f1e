"""NVIDIA GPUs: NCCL (+ gloo for CPU tensors on the same default group), TransformerEngine layer spec, vllm.

Unverified here (no GPU on our machines): the selection logic and the memory hand-off bookkeeping are tested on CPU;
the CUDA calls below are torch's documented allocator/stream API.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from megatron_dapo.platform.base import HandoffDefaults, Platform


class CudaPlatform(Platform):
    name = "cuda"
    # A mixed default group, as verl initialises it: CUDA tensors go over NCCL, CPU tensors over gloo.
    dist_backend = "cpu:gloo,cuda:nccl"
    device_type = "cuda"
    default_enforce_eager = False  # verl's GPU default: CUDA graphs on
    context_parallel_unsupported = None  # TransformerEngine's attention implements CP (checked when TE is used)

    @property
    def default_transformer_impl(self) -> str:  # type: ignore[override]
        return "transformer_engine" if importlib.util.find_spec("transformer_engine") is not None else "local"

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def peak_memory_gb(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def memory_allocated_gb(self) -> float:
        return torch.cuda.memory_allocated() / 2**30

    def memory_handoff_defaults(self) -> HandoffDefaults:
        # verl's megatron defaults for colocated rollout: grads + optimizer + reference off the GPU during rollout;
        # parameters stay (the weight sync reads them) unless actor.offload_params=true. vLLM sleep level 2: the
        # next sync rewrites the weights anyway, so nothing is backed up to host.
        return HandoffDefaults(params=False, grads=True, optimizer=True, reference=True, sleep_level=2)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
