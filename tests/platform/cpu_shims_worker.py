"""Fresh-interpreter check of ``apply_cpu_shims`` + ``CpuPlatform.seed`` (run by test_platform_selection.py).

Prints one JSON line of observations; the test asserts on them. Usage: ``python cpu_shims_worker.py <port>``.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def zeros_device() -> str:
    try:
        return str(torch.zeros(1, device="cuda").device)
    except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled"
        return "error"


def suspension() -> dict:
    """Where ``torch.zeros(device="cuda")`` lands inside and after ``cuda_to_cpu_suspended`` (vLLM's calls), nested
    and with another mode on top (then the block leaves the stack alone)."""
    from megatron_dapo.platform.cpu_shims import cuda_to_cpu_suspended, without_cuda_to_cpu

    out = {}
    with cuda_to_cpu_suspended():
        out["inside"] = zeros_device()
        with cuda_to_cpu_suspended():
            out["nested"] = zeros_device()
        out["after_nested"] = zeros_device()
    out["after"] = zeros_device()
    out["wrapped"] = without_cuda_to_cpu(zeros_device)()
    with torch.device("cpu"):  # a mode above the shims' one
        with cuda_to_cpu_suspended():
            out["under_other_mode"] = zeros_device()
    out["after_other_mode"] = zeros_device()
    return out


def model_compute(platform) -> dict:
    """Inside ``platform.model_compute()`` (the forward and the loss hook): the mode is off, and the megatron-core
    functions of the forward that hard-code CUDA (the softmax's masks) still make CPU tensors."""
    from megatron.core.fusions import fused_softmax

    out = {}
    with platform.model_compute():
        out["zeros"] = zeros_device()
        out["causal_mask"] = str(fused_softmax.get_default_causal_mask(3).device)
        out["window_mask"] = str(fused_softmax.get_sliding_window_causal_mask(3, 3, (1, 0)).device)
        out["zeros_after_spots"] = zeros_device()
    out["after"] = zeros_device()
    return out


def main() -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1], "RANK": "0", "WORLD_SIZE": "1"})
    from megatron.core import tensor_parallel

    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from megatron_dapo.platform.cpu_shims import apply_cpu_shims

    parallel = ParallelConfig(platform="cpu")
    _, platform = init_distributed(parallel)  # applies the CPU shims
    tracker = tensor_parallel.get_cuda_rng_tracker()
    apply_cpu_shims()  # a second call must not replace anything
    seen: dict = {
        "idempotent": tensor_parallel.get_cuda_rng_tracker() is tracker,
        "zeros_device": str(torch.zeros(2, device="cuda").device),
        "cuda_method_device": str(torch.ones(2).cuda().device),
        "current_device": str(torch.cuda.current_device()),
        "tracker_class": type(tracker).__name__,
        "suspended": suspension(),
        "model_compute": model_compute(platform),
    }
    seed = 1234
    init_model_parallel(parallel, seed=seed)  # -> CpuPlatform.seed -> seed_cpu
    seen["seed"] = seed
    seen["default_draw"] = torch.rand(4).tolist()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    seen["tracker_names"] = sorted(tracker.get_states())
    start = tracker.get_states()
    with tracker.fork():  # megatron-core's default stream name: model-parallel-rng
        seen["model_parallel_draw"] = torch.rand(4).tolist()
    with tracker.fork("data-parallel-rng"):
        seen["data_parallel_draw"] = torch.rand(4).tolist()
    # Dropout inside the tracker's fork, as megatron-core's attention does, replays from a saved state.
    # (set_states adopts the dict it is given and forks write into it, hence the copies.)
    x = torch.ones(64)
    tracker.set_states(dict(start))
    with tracker.fork():
        first = torch.nn.functional.dropout(x, p=0.5)
    tracker.set_states(dict(start))
    with tracker.fork():
        again = torch.nn.functional.dropout(x, p=0.5)
    seen["megatron_fork_ok"] = bool(torch.equal(first, again) and 0 < int((first == 0).sum()) < 64)
    destroy_model_parallel()
    torch.distributed.destroy_process_group()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
