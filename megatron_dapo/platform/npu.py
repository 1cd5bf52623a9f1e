"""Ascend NPU: HCCL (+ gloo for CPU tensors on the same default group), torch-npu, MindSpeed, vllm-ascend.

Unverified here (no NPU on our machines): the selection logic, the MindSpeed feature set derived from the config
(``mindspeed_features``) and the memory hand-off bookkeeping are tested on CPU; the runtime calls below follow the
torch-npu, MindSpeed and vllm-ascend sources (see docs/platforms.md). MindSpeed must be imported before any
megatron-core model module so that its patches replace megatron-core's implementations.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
from typing import Any

import torch

from megatron_dapo.platform.base import HandoffDefaults, Platform


def mindspeed_features(p: Any, a: Any) -> dict[str, Any]:
    """MindSpeed arguments for our config, in the form ``mindspeed.megatron_adaptor.repatch`` takes (as verl passes
    its ``override_transformer_config``): fused NPU kernels for what our models use (flash attention, RMSNorm,
    SwiGLU, RoPE) and the parallel (``p``) and recompute (``a``: the actor's) settings MindSpeed's patches read."""
    features: dict[str, Any] = {
        "use_flash_attn": True,  # npu_fusion_attention; causal masking is generated inside (attention_mask=None)
        "use_fused_rmsnorm": True,
        "use_fused_swiglu": True,
        "use_fused_rotary_pos_emb": True,
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "sequence_parallel": bool(p.sequence_parallel),
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "use_distributed_optimizer": bool(p.use_distributed_optimizer),
    }
    if p.context_parallel_size > 1:
        features["context_parallel_algo"] = "megatron_cp_algo"  # ring attention, MindSpeed's default CP algorithm
    if a.recompute != "none":
        features["recompute_granularity"] = a.recompute
        if a.recompute == "full":
            features["recompute_method"] = "uniform"
            features["recompute_num_layers"] = a.recompute_num_layers
    return features


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "cpu:gloo,npu:hccl"
    device_type = "npu"
    has_device_memory = True
    # MindSpeed maps megatron-core's TE spec onto its own fused NPU modules.
    default_transformer_impl = "transformer_engine"
    # MindSpeed's flash attention builds the causal mask itself and expects attention_mask=None.
    causal_mask_needed = False
    context_parallel_unsupported = None  # MindSpeed implements CP (ring / Ulysses)

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
                "platform npu needs MindSpeed (installed from its source repository, see docs/platforms.md)"
            ) from e

    def check_transformer_engine(self, requested: str = "transformer_engine") -> None:
        # No TransformerEngine on Ascend: MindSpeed provides the TE-spec modules once its adaptor is imported.
        if importlib.util.find_spec("mindspeed") is None:
            raise RuntimeError(
                "model.transformer_impl=transformer_engine on platform 'npu' needs MindSpeed (see docs/platforms.md)"
            )

    def configure_model_features(self, parallel: Any, actor: Any) -> None:
        """Turn on MindSpeed's fused kernels for this config (``repatch``, as verl does), before building models."""
        from mindspeed.megatron_adaptor import repatch  # optional: MindSpeed exists on Ascend only

        repatch(mindspeed_features(parallel, actor))

    def device(self) -> torch.device:
        return torch.device("npu", torch.npu.current_device())

    def set_device(self, local_rank: int) -> None:
        torch.npu.set_device(local_rank)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def bridge_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """HCCL: the weights go device to device (never run here: docs/async.md)."""
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # optional: torch-npu exists on Ascend only

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, options)

    def empty_cache(self) -> None:
        torch.npu.empty_cache()

    def peak_memory_gb(self) -> float:
        return torch.npu.max_memory_allocated() / 2**30

    def reset_peak_memory(self) -> None:
        torch.npu.reset_peak_memory_stats()

    def memory_allocated_gb(self) -> float:
        return torch.npu.memory_allocated() / 2**30

    def transformer_config_overrides(self, transformer_impl: str = "local") -> dict[str, Any]:
        # MindSpeed's fused NPU kernels (configure_model_features) replace megatron-core's; its torch.compile /
        # Apex / TE fusions stay off here.
        overrides = super().transformer_config_overrides(transformer_impl)
        overrides.update(bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)
        return overrides

    def memory_handoff_defaults(self) -> HandoffDefaults:
        # vllm-ascend sleeps at level 2 too (worker.py: nothing offloaded, the buffers kept): level 1 would copy a
        # whole weight copy to host and back every step that the next sync overwrites anyway.
        return HandoffDefaults(params=False, grads=True, optimizer=True, reference=True, sleep_level=2)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # torch-npu has no host-register binding: pinned through its caching host allocator, one buffer per
        # offloaded component (the power-of-two rounding applies once per component, not per storage).
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def device_rng_state(self) -> torch.Tensor:
        return torch.npu.get_rng_state()

    def set_device_rng_state(self, state: torch.Tensor) -> None:
        torch.npu.set_rng_state(state)

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        # vllm-ascend refuses wake_up while its NZ weight format is on (its default for quantised weights, and
        # VLLM_ASCEND_ENABLE_NZ=1 by default): RL mode turns NZ off (ascend_config.py RlConfig); older releases
        # without rl_config read the environment variable, which launch/env_ascend.sh and this sets to 0.
        os.environ.setdefault("VLLM_ASCEND_ENABLE_NZ", "0")
        return {
            "gpu_memory_utilization": gpu_memory_utilization,
            "additional_config": {"rl_config": {"enabled": True}},
        }
