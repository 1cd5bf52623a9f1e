"""``config/memory.memory_model``: the per-phase memory of a resolved run as a pure function of the ``RunPlan``, the
architecture and the config's memory settings. Every expected number below is worked out by hand for a small
Qwen2-shaped model (no helper of the model is used to compute them), on the CUDA platform's hand-off and on CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.config.memory import MemoryModel, kv_cache, memory_model
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from tests.helpers.hf_configs import SMALL_QWEN2

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
GIB, MIB = 2**30, 2**20

SMALL = SMALL_QWEN2
# By hand, TP 2 (sequence parallel), 8 ranks -> DP 4; head_dim 256 / 4 = 64, q 256, kv 2 x 64 = 128.
#   one layer, TP-split: qkv 256 x (256 + 2 x 128) + bias 512 = 131584, out 256 x 256 = 65536, MLP 3 x 256 x 512 =
#   393216 -> 590336, 295168 per TP rank; norms 2 x 256 = 512, replicated.
#   vocabulary padded to a multiple of 128 x TP 2: 1024; embedding and output layer 1024 x 256 / TP 2 = 131072 each.
P_RANK = 8 * (590336 // 2 + 512) + 2 * (1024 * 256 // 2) + 256  # 2627840
#   vLLM at rollout TP 2: the unpadded embedding and output layer, the layers' split tensors / 2; norms whole.
P_VLLM = (2 * 1000 * 256 + 8 * 590336) // 2 + 8 * 512 + 256  # 2621696
BF16 = 2
TOKENS = 2 * (512 + 512)  # a micro-batch: 2 sequences of 512 + 512 tokens
#   per token per layer kept for backward: QKV out 512 + rotated Q, K 384 + attention out 256 + fc1 1024 + SwiGLU
#   512 = 2688 elements x 2 B / TP 2, and the norms' inputs/outputs 4 x 256 x 2 B / TP 2 (SP) = 1024 B.
LAYER_NO_CORE = 2688 * BF16 // 2 + 4 * 256 * BF16 // 2  # 3712 B
FLASH_CORE = 4 * 4 // 2  # fused attention keeps its softmax statistics: 4 heads x 4 B / TP 2
LOCAL_CORE = 4 * 1024 * BF16 // 2  # the local spec keeps the probabilities: 4 heads x s 1024 x 2 B / TP 2

BASE = [
    "model.hf_config_dir=/not/read",
    "model.params_dtype=bf16",
    "model.make_vocab_size_divisible_by=128",
    "parallel.platform=cuda",
    "parallel.tensor_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    "parallel.use_distributed_optimizer=true",
    "rollout.tensor_model_parallel_size=2",
    "rollout.gpu_memory_utilization=0.5",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "actor.log_prob_micro_batch_size_per_gpu=2",
    "actor.recompute=none",
    "reward.custom_function.path=null",  # the plan needs no reward file
]


def model_of(*overrides: str, platform: str = "cuda", memory_gb: float | None = 1.0, world: int = 8) -> MemoryModel:
    cfg = load_config(TINY, BASE + [f"parallel.platform={platform}", *overrides])
    arch = model_arch_from_hf(SMALL)
    plan = resolve(cfg, arch, world, make_platform(platform), probe_imports=False)
    return memory_model(plan, arch, cfg, None if memory_gb is None else memory_gb * GIB)


def test_state_terms_by_hand():
    m = model_of()
    assert (m.plan.dp_size, m.params.actor, m.params.rollout) == (4, P_RANK, P_VLLM)
    assert m.weights == P_RANK * BF16
    assert m.grads == P_RANK * 4  # fp32 main grads
    # Distributed optimizer, bf16: fp32 master weights + Adam's two fp32 moments = 12 B per parameter, / DP 4.
    assert m.optimizer == P_RANK * 12 / 4
    assert m.reference == 0  # no KL term
    assert m.vllm_weights == P_VLLM * BF16
    # fp32 parameters have no master copy: 8 B; without the distributed optimizer nothing is sharded.
    assert model_of("model.params_dtype=fp32").optimizer == P_RANK * 8 / 4
    assert model_of("parallel.use_distributed_optimizer=false").optimizer == P_RANK * 12
    # A KL term: the reference holds the actor's weights.
    assert model_of("actor.use_kl_loss=true").reference == P_RANK * BF16


def test_lora_terms_by_hand():
    # actor.lora rank 16 on all four linears, TP 2: per layer (r x in + out x r for each): qkv 16 x (256 + 512) =
    # 12288, o 16 x (256 + 256) = 8192, fc1 16 x (256 + 1024) = 20480, fc2 16 x (512 + 256) = 12288 -> 53248,
    # / TP 2 = 26624 per rank per layer, 8 layers.
    adapters = 8 * 53248 // 2
    m = model_of("actor.lora.rank=16", "actor.use_kl_loss=true")
    assert m.adapter_params == adapters == 212992
    assert m.weights == (P_RANK + adapters) * BF16  # the frozen base plus the adapters
    assert m.grads == adapters * 4  # only the adapters have main grads
    assert m.optimizer == adapters * 12 / 4  # and optimizer state
    assert m.reference == 0  # the KL reference is the actor with its adapters off: no copy
    assert m.numbers()["lora_adapter_params_per_rank"] == adapters
    # Attention only: qkv + o.
    assert model_of("actor.lora.rank=16", "actor.lora.target_modules=[linear_qkv,linear_proj]").adapter_params == (
        8 * (12288 + 8192) // 2
    )


def test_kv_cache_tokens_by_hand():
    # On a device: vLLM's share 0.5 x 1 GiB less its weights; K and V x 8 layers x 2 KV heads / rollout TP 2 x
    # head_dim 64 x 2 B = 2048 B per token.
    m = model_of()
    kv = 0.5 * GIB - P_VLLM * BF16
    assert m.kv.size == kv
    assert m.kv.bytes_per_token == 2 * 8 * (2 // 2) * 64 * BF16 == 2048
    assert m.kv.tokens == int(kv // 2048) == 259583
    # On CPU: rollout.kv_cache_memory_mb (64 in tiny_cpu.yaml), whatever the device size.
    cpu = model_of(platform="cpu")
    assert cpu.kv.size == 64 * MIB and cpu.kv.tokens == 64 * MIB // 2048
    assert cpu.kv.formula == "rollout.kv_cache_memory_mb=64"
    # Too small a KV cache for one sequence of 1024 tokens: a problem, as vLLM would refuse to start.
    short = model_of("rollout.kv_cache_memory_mb=1", platform="cpu")
    assert short.kv.tokens == 512
    assert any("holds 512 tokens at 2048 bytes per token" in p for p in short.problems), short.problems


def test_kv_cache_alone_is_the_models_term():
    """``kv_cache`` (the stand-in engine's size, from the rollout section) is ``memory_model``'s ``kv``."""
    arch = model_arch_from_hf(SMALL)
    for platform, capacity in (("cuda", GIB), ("cpu", None)):
        cfg = load_config(TINY, BASE + [f"parallel.platform={platform}"])
        plan = resolve(cfg, arch, 8, make_platform(platform), probe_imports=False)
        assert kv_cache(plan, arch, cfg.rollout, capacity) == memory_model(plan, arch, cfg, capacity).kv


def test_update_phase_is_the_sum_of_its_terms():
    m = model_of()
    activations = 8 * TOKENS * (LAYER_NO_CORE + FLASH_CORE)  # 8 layers, 1 micro-batch in flight (PP 1)
    logits = TOKENS * (1024 // 2) * BF16  # padded vocab / TP
    chunks = 64 * (1024 // 2) * (2 * BF16 + 8)  # response_log_probs' 64 rows in the backward
    update = m.phase("update")
    # CUDA defaults: vLLM asleep (level 2: nothing of it kept), grads and optimizer back for the update.
    assert update.device == {
        "actor weights": P_RANK * BF16,
        "grads": P_RANK * 4,
        "optimizer": P_RANK * 12 / 4,
        "activations": activations,
        "logits": logits,
        "logit chunks": chunks,
    }
    assert update.host == {}
    expected = P_RANK * BF16 + P_RANK * 4 + P_RANK * 12 / 4 + activations + logits + chunks
    assert update.device_total == expected == m.numbers()["memory_phase_update_bytes"]
    assert m.act.update_bytes == activations == m.numbers()["memory_activations_bytes"]
    # megatron-core's local DotProductAttention (model.attention_backend=local) keeps the s x s probabilities
    # instead of the softmax statistics, and takes an explicit causal mask (one [s, s] bool tensor); the local
    # spec's default SDPA core attention keeps the statistics, as fused attention does, and takes no mask. On CPU
    # nothing is offloaded and vLLM never sleeps, so its weights and KV cache stay through the update.
    cpu = model_of("model.attention_backend=local", platform="cpu", memory_gb=None)
    assert cpu.act.update_bytes == 8 * TOKENS * (LAYER_NO_CORE + LOCAL_CORE)
    assert cpu.phase("update").device["causal mask"] == 1024 * 1024
    sdpa = model_of(platform="cpu", memory_gb=None)
    assert sdpa.act.update_bytes == 8 * TOKENS * (LAYER_NO_CORE + FLASH_CORE)
    assert "causal mask" not in sdpa.phase("update").device
    cpu_update = cpu.phase("update")
    assert cpu_update.device["vLLM weights"] == P_VLLM * BF16 and cpu_update.device["vLLM KV cache"] == 64 * MIB
    assert cpu_update.device_total == sum(cpu_update.device.values()) and cpu_update.fits is None


def test_startup_row_holds_only_what_is_resident_before_vllm():
    # CUDA defaults: grads freed and the optimizer offloaded before the engine is built; the reference (a KL term)
    # is built after it, so it is in neither column.
    m = model_of("actor.use_kl_loss=true")
    startup = m.phase("startup")
    assert startup.device == {
        "actor weights": P_RANK * BF16,
        "vLLM weights": P_VLLM * BF16,
        "vLLM KV cache": 0.5 * GIB - P_VLLM * BF16,
    }
    assert startup.host == {"optimizer": P_RANK * 12 / 4}
    assert m.startup is not None and m.startup.resident == P_RANK * BF16
    assert (m.startup.free, m.startup.asked) == (GIB - P_RANK * BF16, 0.5 * GIB)
    assert startup.fits is True and startup.note.startswith("vLLM start-up: free 1018.99 MiB >= ")
    # Nothing offloaded: grads and optimizer state are resident when vLLM starts.
    kept = model_of("actor.offload_grads=false", "actor.offload_optimizer=false")
    assert kept.startup.resident == P_RANK * BF16 + P_RANK * 4 + P_RANK * 12 / 4
    assert kept.phase("startup").host == {}
    # Params offloaded too: they leave before the engine is built.
    params = model_of("actor.offload_params=true").phase("startup")
    assert "actor weights" not in params.device and params.host["actor weights"] == P_RANK * BF16
    # On CPU (no start-up rule) everything the actor has is there, and vLLM's KV cache is its configured size.
    cpu = model_of(platform="cpu")
    assert cpu.startup is None
    assert set(cpu.phase("startup").device) == {"actor weights", "grads", "optimizer", "vLLM weights", "vLLM KV cache"}


def test_startup_rule_that_does_not_hold_is_a_problem():
    # 0.2 GiB device, vLLM asks 0.95 of it; the optimizer kept on the device leaves too little free.
    m = model_of("rollout.gpu_memory_utilization=0.95", "actor.offload_optimizer=false", memory_gb=0.2)
    assert m.startup.resident == P_RANK * BF16 + P_RANK * 12 / 4 and not m.startup.fits
    assert m.phase("startup").fits is False
    assert [p for p in m.problems if p.startswith("vLLM start-up")], m.problems
    assert "actor.offload_optimizer=true" in m.problems[-1] and "actor.offload_grads" not in m.problems[-1]
    # The start-up row is a problem, not a warning; generation over the device is a warning.
    assert not any("'startup'" in w for w in m.warnings)
    assert any(w.startswith("memory estimate of phase 'gen'") for w in m.warnings)


def test_the_model_reads_the_plan():
    # The hand-off, the sleep and the reference come from the RunPlan, not from the config: a plan whose hand-off
    # keeps the optimizer on the device puts it there while generating.
    cfg = load_config(TINY, BASE)
    arch = model_arch_from_hf(SMALL)
    plan = resolve(cfg, arch, 8, make_platform("cuda"), probe_imports=False)
    kept = dataclasses.replace(plan, handoff=dataclasses.replace(plan.handoff, optimizer=False))
    assert "optimizer" not in memory_model(plan, arch, cfg, GIB).phase("gen").device
    assert memory_model(kept, arch, cfg, GIB).phase("gen").device["optimizer"] == P_RANK * 12 / 4
    # Level 1: vLLM's weights wait in pinned host memory while it sleeps, and count in the pinned host total.
    level_1 = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, sleep_level=1))
    level_1 = dataclasses.replace(level_1, handoff=dataclasses.replace(plan.handoff, sleep_level=1))
    m = memory_model(level_1, arch, cfg, GIB)
    assert m.phase("old_log_prob").host == {"optimizer": P_RANK * 12 / 4, "vLLM weights": P_VLLM * BF16}
    assert m.pinned_host == P_RANK * 12 / 4 + P_VLLM * BF16
    # Pure: the same inputs give an equal model, and the model cannot be changed.
    assert memory_model(plan, arch, cfg, GIB) == memory_model(plan, arch, cfg, GIB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.weights = 0  # type: ignore[misc]


def test_peak_and_numbers():
    m = model_of()
    # With default offloading startup holds exactly what generation holds; the step's phase is named.
    assert m.phase("startup").device_total == m.phase("gen").device_total == P_RANK * BF16 + 0.5 * GIB
    assert m.peak.name == "gen"
    assert [ph.name for ph in m.phases if not ph.runs] == ["old_log_prob", "ref"]  # on-policy, no KL term
    numbers = m.numbers()
    assert list(numbers)[:13] == [
        "world_size",
        "tp",
        "pp",
        "dp",
        "rollout_tp",
        "rollout_dp",
        "trajectories_per_step",
        "max_tokens_per_step",
        "mini_batches_per_step",
        "optimizer_steps_per_step",
        "sequences_per_mini_batch_per_rank",
        "micro_batches_per_mini_batch",
        "log_prob_micro_batches_per_step",
    ]
    assert numbers["memory_peak_bytes"] == P_RANK * BF16 + 0.5 * GIB
    assert numbers["memory_pinned_host_bytes"] == P_RANK * 12 / 4  # the offloaded optimizer; grads are freed
    assert numbers["memory_startup_resident_bytes"] == P_RANK * BF16
    assert numbers["kv_cache_tokens"] == 259583 and numbers["padded_vocab"] == 1024
    assert {f"memory_phase_{name}_bytes" for name in ("startup", "sync", "gen", "update", "save")} <= set(numbers)
    # No device size: no start-up rule and nothing compared with a capacity.
    none = model_of(memory_gb=None)
    assert none.startup is None and "memory_startup_free_bytes" not in none.numbers()
    assert all(ph.fits is None for ph in none.phases) and none.warnings == ()


def test_async_splits_the_engine_off_the_training_ranks():
    # trainer.mode=async on 12 ranks: the first 8 train (TP 2, DP 4: the same shards as above), the last 4 hold the
    # engines (rollout TP 2 -> 2 replicas). A training rank holds no vLLM term in any phase and offloads nothing (no
    # engine to make room for); a rollout rank holds vLLM's weights, its KV cache (0.5 x 1 GiB less the weights) and
    # a received bucket (16 MiB, tiny_cpu.yaml) with vLLM's bf16 staging copy of it.
    m = model_of("trainer.mode=async", "placement.rollout_ranks=4", world=12)
    assert (m.plan.train_world, m.plan.rollout_world, m.plan.dp_size, m.plan.rollout.dp_size) == (8, 4, 4, 2)
    for phase in m.phases:
        assert not [k for k in phase.device if k.startswith("vLLM")], phase
        assert phase.host == {}, phase
    # The push it sent keeps a copy of the stage's HF tensors (bf16) until the rollout ranks take it, through the
    # next step: the whole unpadded model at PP 1, 8 x (590336 + 512) + 2 x 1000 x 256 + 256 = 5239040 parameters.
    push = {"push in flight": 5239040 * BF16}
    assert m.phase("gen").device == {
        "actor weights": P_RANK * BF16, "grads": P_RANK * 4, "optimizer": P_RANK * 12 / 4, **push
    }  # fmt: skip
    assert "push in flight" not in m.phase("startup").device
    assert m.phase("sync").device["sync buckets"] == 16 * MIB  # the gathered bucket only: no staging copy here
    assert m.rollout_rank == P_VLLM * BF16 + (0.5 * GIB - P_VLLM * BF16) + 2 * 16 * MIB
    assert m.numbers()["memory_rollout_rank_bytes"] == m.rollout_rank and m.startup is None
