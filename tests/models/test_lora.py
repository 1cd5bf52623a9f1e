"""LoRA on megatron-core's parallel linears (``megatron_dapo/models/lora.py``) against HF transformers + LoRA, fp32.

``lora_worker.py`` runs every layout in one 2-process torchrun (process start-up dominates): dense qwen2 at DP 2,
TP 2, TP 2 + SP and PP 2 against HF with the same adapters (fused qkv/fc1 adapters split into peft's q/k/v and
gate/up adapters), and qwen2_moe (SequentialMLP experts, EP 2, expert TP 1, TP 2 + SP) against its own merged
weights; expert TP 2 must be refused. Each test asserts on one layout's numbers, on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dapo.config import config_problems, load_config
from megatron_dapo.config.memory import lora_stage_params
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.lora import LORA_TARGETS, apply_lora, base_param_name, resolve_targets
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("lora_worker.py")
PORT = 29840  # this area's range is 29800-29849
DENSE = ["tp1-pp1", "tp2-pp1", "tp2-pp1-sp", "tp1-pp2"]
MOE = ["moe-ep2-tp2-pp1-etp1-sp", "moe-ep1-tp2-pp1-sp"]
HYBRID = ["hybrid-tp2-pp1-sp", "hybrid-tp1-pp2"]  # a tiny Qwen3.5: Gated DeltaNet layers 0-2, 4, 5; attention 3
LOGITS_ATOL = 1e-5  # ours + LoRA vs HF + LoRA, fp32 logits on the non-pad positions (measured ~2.4e-7)
GRAD_RTOL = 1e-5  # adapter gradient: max|Δ| / max|g_hf| (measured < 1e-6)
LOSS_ATOL = 1e-5
MERGE_ATOL = 1e-5  # merged weights' logits vs the adapters' (fp32 rounding only)
# The hybrid's: its gated delta rule compounds the rounding over the sequence (measured 1.4e-5 at TP 2 + SP); a merge
# into the wrong rows would move them as much as the adapters do (lora_vs_base > 1e-2).
HYBRID_MERGE_ATOL = 5e-5
UNMERGE_ATOL = 1e-6  # base weights after merge + unmerge (entries ~0.05; rounding of W + Δ - Δ)
LAYERS = 4  # the tiny models' layers


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lora")
    run_torchrun(WORKER, 2, ["--layouts", ",".join(DENSE + MOE + HYBRID), "--out", str(out)], port=PORT, timeout=480)
    return [json.loads((out / f"rank{r}.json").read_text())["layouts"] for r in range(2)]


def _common_problems(where: str, r: dict, merge_atol: float = MERGE_ATOL) -> list[str]:
    """What every wrapped layout must show: bit-exact no-ops, grads on adapters only, merge/unmerge."""
    problems = []
    if r["last_stage"]:
        for key in ("untrained_vs_base", "disabled_vs_base"):
            if r[key] != 0.0:  # an untrained adapter (B = 0) / disabled adapters change no bit
                problems.append(f"{where}: {key} = {r[key]}")
        if not r["lora_vs_base"] > 1e-2:
            problems.append(f"{where}: the adapters barely change the logits ({r['lora_vs_base']})")
        if not r["merge"]["merged_vs_lora_logits"] <= merge_atol:
            problems.append(f"{where}: merged logits differ by {r['merge']['merged_vs_lora_logits']}")
    g = r["base_grads"]
    if g["leaked"] or g["adapters_trainable"] != r["adapter_params"] or g["base_params"] == 0:
        problems.append(f"{where}: base grads {g}")
    m = r["merge"]
    if (
        m["merged"] != r["adapter_params"] // 2
        or not m["weights_moved"] > 0
        or not m["unmerge_max_abs"] <= UNMERGE_ATOL
    ):
        problems.append(f"{where}: merge {m}")
    return problems


@pytest.mark.parametrize("name", DENSE)
def test_lora_matches_hf_lora(reports, name):
    pp = 2 if "pp2" in name else 1
    problems = []
    wrapped = set()
    for rank, layouts in enumerate(reports):
        r = layouts[name]
        where = f"{name} rank {rank}"
        problems += _common_problems(where, r)
        wrapped.update(r["wrapped"])
        # each rank wraps the four targets of its layers, two adapter weights each
        if len(r["wrapped"]) != 4 * LAYERS // pp or r["adapter_params"] != 2 * len(r["wrapped"]):
            problems.append(f"{where}: wrapped {r['wrapped']}, {r['adapter_params']} adapter params")
        sd = r["state_dict"]
        if sd["to_wrap_keys"] or not sd["base_qkv_key"] or sd["adapter_keys"] != r["adapter_params"]:
            problems.append(f"{where}: state_dict {sd}")
        for g in r["adapter_grads"]:
            if not g["rel_err"] <= GRAD_RTOL or not g["absmax"] > 0:
                problems.append(f"{where}: adapter grad {g}")
        if r["last_stage"]:
            if not r["lora_vs_hf"] <= LOGITS_ATOL:
                problems.append(f"{where}: logits vs HF + LoRA differ by {r['lora_vs_hf']}")
            if len(r["losses"]) != 2 or any(abs(ours - hf) > LOSS_ATOL for ours, hf in r["losses"]):
                problems.append(f"{where}: losses {r['losses']}")
    if len(wrapped) != 4 * LAYERS:
        problems.append(f"{name}: {len(wrapped)} layers wrapped over all ranks, expected {4 * LAYERS}")
    assert not problems, json.dumps(problems, indent=1)


def test_lora_moe_sequential_experts(reports):
    problems = []
    for rank, layouts in enumerate(reports):
        r = layouts[MOE[0]]
        where = f"{MOE[0]} rank {rank}"
        problems += _common_problems(where, r)
        experts = [n for n in r["wrapped"] if ".experts.local_experts." in n]
        shared = [n for n in r["wrapped"] if ".shared_experts." in n]
        # 3 MoE layers x 4 local experts (8 over EP 2) x fc1/fc2; a shared expert's fc1/fc2 per MoE layer
        if len(experts) != 3 * 4 * 2 or len(shared) != 3 * 2:
            problems.append(f"{where}: wrapped {r['wrapped']}")
        if r["zero_grad_adapters"]:
            problems.append(f"{where}: adapters without gradient {r['zero_grad_adapters']}")
    assert not problems, json.dumps(problems, indent=1)


@pytest.mark.parametrize("name", HYBRID)
def test_lora_on_gated_delta_net_layers(reports, name):
    """``all-linear`` on a hybrid wraps each Gated DeltaNet layer's in_proj and out_proj, the attention layer's
    linear_qkv and linear_proj, and every MLP; the LoRA forward equals the merged model's (which
    ``test_models_qwen35`` compares with transformers at these layouts) and every adapter gets a gradient."""
    problems, wrapped = [], set()
    for rank, layouts in enumerate(reports):
        r = layouts[name]
        where = f"{name} rank {rank}"
        problems += _common_problems(where, r, HYBRID_MERGE_ATOL)
        wrapped.update(r["wrapped"])
        if r["zero_grad_adapters"]:
            problems.append(f"{where}: adapters without gradient {r['zero_grad_adapters']}")
        # check's memory model counts this rank's adapter parameters (config/memory.lora_stage_params)
        tp, pp = (2, 1) if "tp2" in name else (1, 2)
        plan = SimpleNamespace(tp=tp, pp=pp, vpp=None, ep=1)
        lora = LoRAConfig(rank=4, target_modules=["all-linear"])  # the worker's RANK
        counted = lora_stage_params(_hybrid_arch(), lora, plan, r["pp_rank"])
        if sum(counted) != r["adapter_numel"]:
            problems.append(f"{where}: check counts {counted} adapter parameters, the model has {r['adapter_numel']}")
    linear = reports[0][name]["linear_layers"]
    expected = {f"decoder.layers.{i}.self_attention.{m}" for i in linear for m in ("in_proj", "out_proj")}
    expected |= {f"decoder.layers.{i}.self_attention.{m}" for i in (3,) for m in ("linear_qkv", "linear_proj")}
    expected |= {f"decoder.layers.{i}.mlp.{m}" for i in range(6) for m in ("linear_fc1", "linear_fc2")}
    if linear != [0, 1, 2, 4, 5] or wrapped != expected:
        problems.append(f"{name}: wrapped {sorted(wrapped ^ expected)} differ from the expected names")
    assert not problems, json.dumps(problems, indent=1)


def _hybrid_arch():
    from megatron_dapo.models.families import model_arch_from_hf
    from tests.models.qwen35_worker import tiny_hybrid_config

    return model_arch_from_hf(tiny_hybrid_config("qwen3_5").to_dict())


def test_lora_refuses_expert_tensor_parallelism(reports):
    for layouts in reports:
        assert "expert tensor parallelism > 1 are not handled" in layouts[MOE[1]]["refused"]


def test_targets_names_and_off():
    assert resolve_targets(["all-linear"]) == LORA_TARGETS
    assert resolve_targets(["linear_fc2", "linear_qkv"]) == ("linear_qkv", "linear_fc2")
    with pytest.raises(ValueError, match="q_proj"):
        resolve_targets(["q_proj"])
    assert LoRAConfig().rank == 0 and apply_lora([object()], LoRAConfig()) == []  # rank 0 = off, nothing touched
    assert base_param_name("decoder.layers.0.self_attention.linear_qkv.to_wrap.weight") == (
        "decoder.layers.0.self_attention.linear_qkv.weight"
    )


def test_lora_config_rules():
    ok = load_config(None, ["actor.lora.rank=8", "actor.lora.target_modules=[all-linear]"])
    assert ok.actor.lora.rank == 8 and not config_problems(ok)
    cfg = load_config(None, [])
    cfg.actor.lora = LoRAConfig(rank=3, alpha=0.0, dropout=1.0, target_modules=["linear_qkv", "q_proj"])
    cfg.parallel.tensor_model_parallel_size = 2
    text = "\n".join(config_problems(cfg))
    for key in ("actor.lora.alpha=0.0", "actor.lora.dropout=1.0", "actor.lora.target_modules=", "actor.lora.rank=3"):
        assert key in text, text
    assert "multiple of parallel.tensor_model_parallel_size=2" in text
