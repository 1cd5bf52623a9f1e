"""Ascend NPU: HCCL, torch-npu, MindSpeed's megatron-core adaptor, vllm-ascend.

Unverified here (no NPU on our machines): the selection logic is tested; the calls below follow the torch-npu and
MindSpeed documentation. MindSpeed must be imported before any megatron-core model module so that its patches
(fused RMSNorm, rotary, flash attention) replace megatron-core's implementations.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from megatron_dapo.platform.base import Platform


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    device_type = "npu"
    vllm_package = "vllm-ascend"

    def setup(self) -> None:
        try:
            importlib.import_module("torch_npu")
        except ImportError as e:
            raise RuntimeError("platform npu needs torch-npu: pip install 'megatron-dapo[npu]'") from e
        try:
            # Patches megatron-core in place; must run before megatron.core.models is imported by us.
            importlib.import_module("mindspeed.megatron_adaptor")
        except ImportError as e:
            raise RuntimeError(
                "platform npu needs MindSpeed (installed from its source repository, see README 'Ascend NPU')"
            ) from e

    def device(self) -> torch.device:
        return torch.device("npu", torch.npu.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.npu.set_device(local_rank)

    def use_transformer_engine(self) -> bool:
        # MindSpeed maps megatron-core's TE spec onto its own fused NPU modules.
        return True

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def max_memory_allocated_gb(self) -> float:
        return torch.npu.max_memory_allocated() / 2**30

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
