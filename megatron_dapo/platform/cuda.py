"""NVIDIA GPUs: NCCL (+ gloo for CPU tensors on the same default group), TransformerEngine layer spec, vllm.

Unverified here (no GPU on our machines): the selection logic and the memory hand-off bookkeeping are tested on CPU;
the CUDA calls below are torch's documented allocator/stream API.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from megatron_dapo.platform.base import HandoffDefaults, Platform


class CudaPlatform(Platform):
    name = "cuda"
    # A mixed default group, as verl initialises it: CUDA tensors go over NCCL, CPU tensors over gloo.
    dist_backend = "cpu:gloo,cuda:nccl"
    device_type = "cuda"
    has_device_memory = True
    default_enforce_eager = False  # verl's GPU default: CUDA graphs on
    context_parallel_unsupported = None  # TransformerEngine's attention implements CP (checked when TE is used)

    # model.transformer_impl=auto needs TransformerEngine (its absence is an error naming the fix): TE's fused
    # kernels (norms, fp8, CP) are what large runs use. model.transformer_impl=local asks for the local spec
    # explicitly; its core attention is torch's SDPA by default (model.attention_backend, docs/platforms.md).
    default_transformer_impl = "transformer_engine"

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def bridge_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """NCCL: the weights go device to device (never run here: docs/async.md)."""
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, options)

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
        # Page-locked in place, exactly ``nbytes``: ``pin_memory=True`` goes through the caching host allocator,
        # which rounds every request up to a power of two and keeps the block (up to 2x the plan).
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        if nbytes:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
            # Held here until free_host_buffer unregisters it: memory freed (and reused by the host allocator) while
            # still registered leaves a stale mapping behind (docs/platforms.md, "resource already mapped").
            self._registered_host_buffers()[buffer.data_ptr()] = buffer
        return buffer

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() and self._registered_host_buffers().pop(buffer.data_ptr(), None) is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))

    def _registered_host_buffers(self) -> dict[int, torch.Tensor]:
        if not hasattr(self, "_host_registered"):
            self._host_registered: dict[int, torch.Tensor] = {}
        return self._host_registered

    def device_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_device_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        # enable_sleep_mode comes from the engine (rollout.free_cache_engine), not from here.
        return {"gpu_memory_utilization": gpu_memory_utilization}
