"""Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet + gated attention, docs/qwen35.md) vs HF transformers.

``qwen35_worker.py`` records logits against transformers' fp32 forward and every local gradient against its float64
backward, for the layouts below in one torchrun launch of two processes (TP 1 with DP 2, TP 2 + SP, PP 2, EP 2, EP 2
inside TP 2), the weights read by the HF-direct start from transformers' own saved checkpoints, and a Megatron
checkpoint saved at TP 2 + SP and loaded back in the later layouts; the tests assert.
Without processes: the HF config → ``ModelArch`` / ``TransformerConfig`` mapping, the name map against the HF models'
own parameters, the layout transforms against HF's own in-projection split, and the layouts megatron-core cannot run
(refused, named).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun
from tests.models.qwen35_worker import FAMILIES, save_tiny_hybrid, tiny_hybrid_config, tiny_hybrid_model

WORKER = Path(__file__).with_name("qwen35_worker.py")
# fp32 against fp32 with logits of magnitude ~3: the measured max |Δ| is below 1e-5 on every layout (the torch chunked
# delta rule solves its triangular system by substitution, transformers' with solve_triangular); a wrong map, TP
# slice, norm offset or layer pattern moves them by > 1e-2.
LOGITS_ATOL = 1e-4
# Gradients: Megatron in fp32 against transformers in float64. Measured relative errors (Frobenius over the shard, and
# max-abs over the tensor's max) reach 1e-4 on the GDN's A_log / dt_bias (two values per shard, a long fp32 chain);
# a missing TP reduction or a wrong slice is > 1e-1 (the GDN output norm's TP sum was: 0.6 to 1.1).
GRAD_RTOL = 3e-4
LAYOUTS = ("tp1-pp1-ep1", "tp2-pp1-ep1-sp", "tp1-pp2-ep1", "tp1-pp1-ep2", "tp2-pp1-ep2-etp1-sp")
PORT = 29946  # this file's: 29946-29949


SAVE_AT = "tp2-pp1-ep1-sp"  # saves the Megatron checkpoint; the later layouts load it resharded


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    out = tmp_path_factory.mktemp("qwen35")
    for family in FAMILIES:
        save_tiny_hybrid(family, out / "hf" / family)
        convert_hf_to_mcore(out / "hf" / family, out / "converted" / family)
    args = ["--layouts", ",".join(LAYOUTS), "--out", str(out), "--hf-root", str(out / "hf")]
    args += ["--ckpt-root", str(out / "ckpt"), "--save-at", SAVE_AT, "--converted-root", str(out / "converted")]
    run_torchrun(WORKER, 2, args, port=PORT, timeout=600)
    return out


@pytest.fixture(scope="module")
def reports(run_dir) -> list[dict]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def _arch(family: str):
    from megatron_dapo.models.families import model_arch_from_hf

    return model_arch_from_hf(tiny_hybrid_config(family).to_dict())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_logits_and_grads_match_hf(reports, layout, family):
    from megatron_dapo.models.families import param_mappings

    arch = _arch(family)
    pp = 2 if "-pp2-" in layout else 1
    per_stage = arch.num_layers // pp
    problems = []
    for rank in reports:
        entry = rank["layouts"][layout]
        got = entry["families"][family]
        stage = entry["pp_rank"]
        want = [i for i in range(stage * per_stage, (stage + 1) * per_stage) if arch.is_linear_layer(i)]
        if got["loaded"] != "hf":
            problems.append(f"rank {entry['rank']}: loaded from {got['loaded']}, expected the HF-direct start")
        if got["gdn_layers"] != want:
            problems.append(f"rank {entry['rank']}: Gated DeltaNet layers {got['gdn_layers']}, expected {want}")
        for g in got["grads"]:
            if not (g["ref_absmax"] > 0 and g["rel_err_norm"] <= GRAD_RTOL and g["rel_err"] <= GRAD_RTOL):
                problems.append(f"rank {entry['rank']} {g['mcore']}: grad {g}")
        if stage == pp - 1:
            for mb in ("0", "1"):
                lg = got["logits"].get(mb)
                if lg is None or not (lg["max_abs"] <= LOGITS_ATOL and lg["ref_absmax"] > 1.0):
                    problems.append(f"rank {entry['rank']} micro-batch {mb}: logits {lg}")
    # Every mapped tensor compared, on each rank holding (a slice of) it: 2 / PP ranks, an expert's on 2 / (PP x EP).
    ep = 2 if "-ep2" in layout else 1
    counts = Counter(g["mcore"] for rank in reports for g in rank["layouts"][layout]["families"][family]["grads"])
    for m in param_mappings(arch):
        want = 2 // (pp * ep) if m.is_expert else 2 // pp
        if counts.pop(m.mcore, 0) != want:
            problems.append(f"{m.mcore}: compared on the wrong number of ranks (expected {want})")
    assert not counts and not problems, "\n".join(problems[:30] + sorted(counts)[:5])


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_checkpoint_round_trip(run_dir, reports, family):
    """Saved by megatron-core's ``dist_checkpointing`` at TP 2 + SP and loaded at PP 2, EP 2 and EP 2 in TP 2, and
    ``convert hf-to-mcore``'s checkpoint loaded in every layout: every parameter as the HF-direct start made it,
    exactly. The converter writes megatron-core's own keys: the TransformerEngine spec's, per layer (a hybrid block
    is non-homogeneous), a GDN layer's input norm as ``in_proj.layer_norm_weight``, its in_proj and conv1d in
    megatron-core's pieces."""
    from megatron_dapo.weights.dist_format import RELEASE_DIR
    from megatron_dapo.weights.dist_reader import DistCheckpointReader

    later = LAYOUTS[LAYOUTS.index(SAVE_AT) + 1 :]
    for rank in reports:
        for layout in LAYOUTS:
            got = rank["layouts"][layout]["families"][family]
            checks = [got["converted"]] + ([got["reload"]] if layout in later else [])
            for c in checks:
                assert c is not None and c["same_names"] and c["max_abs_diff"] == 0.0, (layout, c)
    keys = set(DistCheckpointReader(run_dir / "ckpt" / family).keys())
    assert set(DistCheckpointReader(run_dir / "converted" / family / RELEASE_DIR).keys()) == keys
    gdn = "decoder.layers.0.self_attention."
    pieces = {f"in_proj.weight.{p}" for p in ("query", "key", "value", "z", "beta", "alpha")}
    pieces |= {f"conv1d.weight.{p}" for p in ("query", "key", "value")} | {"in_proj.layer_norm_weight"}
    assert {gdn + p for p in pieces} <= keys, sorted(k for k in keys if k.startswith(gdn))
    full = f"decoder.layers.{_arch(family).linear_attention_freq.index(0)}.self_attention.linear_qkv.weight"
    assert full in keys


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_checkpoint_to_hf(run_dir, reports, family, tmp_path):
    """``convert mcore-to-hf`` of megatron-core's own checkpoint (saved at TP 2 + SP): every tensor of the HF text
    model back (the GDN output norm through w - 1 + 1: within an fp32 rounding)."""
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings
    from megatron_dapo.weights.convert import convert_mcore_to_hf
    from megatron_dapo.weights.safetensors_io import SafetensorsDir

    hf_dir = run_dir / "hf" / family
    convert_mcore_to_hf(run_dir / "ckpt" / family, tmp_path, hf_config_dir=hf_dir)
    arch = model_arch_from_hf(hf_dir)
    with SafetensorsDir(hf_dir) as want, SafetensorsDir(tmp_path) as got:
        for m in param_mappings(arch):
            for name in m.hf:
                atol = 1e-6 if m.kind == "norm_offset" else 0.0
                torch.testing.assert_close(got.get(name), want.get(name), rtol=0, atol=atol, msg=name)


def test_hybrid_arch_and_config_mapping():
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.models.builder import moe_config_kwargs
    from megatron_dapo.models.families import from_te_name, model_arch_from_hf, to_te_name
    from megatron_dapo.models.linear_attention import linear_attention_config_kwargs

    q35 = _arch("qwen3_5")
    assert q35.family.name == "qwen3_5" and q35.hf_prefix == "model.language_model." and not q35.is_moe
    # 6 layers at interval 4: one full-attention layer (3), the pattern not a multiple of the interval.
    assert q35.linear_attention_freq == [1, 1, 1, 0, 1, 1]
    assert (q35.rotary_percent, q35.attention_output_gate, q35.zero_centered_norms) == (0.25, True, True)
    kw = linear_attention_config_kwargs(q35)
    assert kw["experimental_attention_variant"] == "gated_delta_net" and kw["linear_attention_freq"] == [
        1,
        1,
        1,
        0,
        1,
        1,
    ]
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"], kw["linear_value_head_dim"]) == (2, 4, 8)
    assert kw["layernorm_zero_centered_gamma"] is True and kw["attention_output_gate"] is True
    assert q35.gated_delta_net.in_proj_sections == (32, 32, 32, 32, 4, 4)
    # Checkpoint (TE spec) names: a GDN layer's input norm fuses into in_proj, a full-attention layer's into linear_qkv.
    gdn_norm, attn_norm = "decoder.layers.0.input_layernorm.weight", "decoder.layers.3.input_layernorm.weight"
    assert to_te_name(gdn_norm, q35) == "decoder.layers.0.self_attention.in_proj.layer_norm_weight"
    assert to_te_name(attn_norm, q35) == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert from_te_name(to_te_name(gdn_norm, q35)) == gdn_norm and from_te_name(to_te_name(attn_norm, q35)) == attn_norm

    nxt = _arch("qwen3_next")
    assert nxt.hf_prefix == "model." and nxt.gated_delta_net.grouped_in_proj
    assert nxt.linear_attention_freq == [1, 0, 1, 0, 1, 0] and nxt.moe_layers == (1, 2, 3, 4, 5)
    moe = moe_config_kwargs(nxt, ParallelConfig())
    assert moe["moe_shared_expert_intermediate_size"] == 48 and moe["moe_shared_expert_gate"] is True
    assert moe["moe_router_pre_softmax"] is False  # softmax over all experts, top-k renormalised
    assert linear_attention_config_kwargs(model_arch_from_hf(_plain_qwen3())) == {}

    # Text-only configs: the decoder under model.; Qwen3.5-MoE has every layer MoE and no dense intermediate size.
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    text = model_arch_from_hf(Qwen3_5TextConfig(num_hidden_layers=8).to_dict())
    assert text.family.name == "qwen3_5" and text.hf_prefix == "model."
    assert text.linear_attention_freq == [1, 1, 1, 0, 1, 1, 1, 0]
    moe_text = Qwen3_5MoeTextConfig(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2).to_dict()
    moe_text.pop("intermediate_size", None)
    m35 = model_arch_from_hf(moe_text)
    assert m35.family.name == "qwen3_5_moe" and m35.moe_layers == (0, 1, 2, 3) and m35.norm_topk_prob
    assert m35.ffn_hidden_size == m35.moe_ffn_hidden_size and m35.moe_shared_expert_ffn_hidden_size == 512


def _plain_qwen3() -> dict:
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    return tiny_hf_config("qwen3").to_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_name_map_covers_the_hf_model(family):
    """Every HF parameter of the text model is mapped once, with the shape the map expects; what is left is the
    vision tower (ignored on load), and every transform inverts exactly (also split over TP 2 and merged back)."""
    from megatron_dapo.models.families import is_ignorable_hf_name, param_mappings
    from megatron_dapo.weights.layout import hf_shapes, hf_to_mcore, mcore_to_hf, tp_merge, tp_shard, unfuse_hf_experts

    arch = _arch(family)
    hf = unfuse_hf_experts({n: p.detach() for n, p in tiny_hybrid_model(family).named_parameters()})
    mapped = [n for m in param_mappings(arch) for n in m.hf]
    assert len(mapped) == len(set(mapped))
    left = set(hf) - set(mapped)
    assert all(is_ignorable_hf_name(arch, n) for n in left), sorted(left)[:5]
    assert (family != "qwen3_next") == any(n.startswith("model.visual.") for n in left)
    for m in param_mappings(arch):
        tensors = [hf[n] for n in m.hf]
        assert [tuple(t.shape) for t in tensors] == [tuple(s) for s in hf_shapes(m, arch)], m.mcore
        full = hf_to_mcore(m, tensors, arch, arch.vocab_size)
        for got, want in zip(mcore_to_hf(m, full, arch), tensors):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if m.kind == "norm_offset" else 0)
        if m.tp_dim is not None:
            shards = [tp_shard(full, m.kind, m.tp_dim, 2, r, m.sections) for r in range(2)]
            assert torch.equal(tp_merge(shards, m.kind, m.tp_dim, m.sections), full), m.mcore


def test_grouped_in_proj_matches_hf_split():
    """Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba, taken apart by ``hf_to_mcore``, against transformers' own
    ``fix_query_key_value_ordering`` on the projections of the identity; and the TP 2 slice of rank 1 holds the
    second key head's q and k and the second pair of value heads' v, z, beta and alpha."""
    from megatron_dapo.models.families import param_mappings
    from megatron_dapo.weights.layout import hf_to_mcore, tp_shard

    arch = _arch("qwen3_next")
    model = tiny_hybrid_model("qwen3_next")
    gdn_module = model.model.layers[0].linear_attn
    m = next(x for x in param_mappings(arch) if x.mcore == "decoder.layers.0.self_attention.in_proj.weight")
    full = hf_to_mcore(m, [gdn_module.in_proj_qkvz.weight.detach(), gdn_module.in_proj_ba.weight.detach()], arch, 0)
    eye = torch.eye(arch.hidden_size)[None]
    with torch.no_grad():
        q, k, v, z, b, a = gdn_module.fix_query_key_value_ordering(
            gdn_module.in_proj_qkvz(eye), gdn_module.in_proj_ba(eye)
        )
    want = torch.cat([t.reshape(arch.hidden_size, -1) for t in (q, k, v, z, b, a)], dim=1).T
    assert torch.equal(full, want)
    rank1 = tp_shard(full, m.kind, m.tp_dim, 2, 1, m.sections)
    halves = [t.reshape(arch.hidden_size, -1).T.chunk(2)[1] for t in (q, k, v, z, b, a)]
    assert torch.equal(rank1, torch.cat(halves))


def test_layouts_megatron_core_cannot_run_are_refused():
    from megatron_dapo.models.families import layout_problems

    arch = _arch("qwen3_5")
    assert layout_problems(arch, 2, 1, False) == [] and layout_problems(arch, 1, 1, None) == []
    (cp,) = layout_problems(arch, 1, 2, False)
    assert "context_parallel_size=2" in cp and "GatedDeltaNetContextParallel" in cp and "set it to 1" in cp
    (packed,) = layout_problems(arch, 1, 1, True)
    assert "actor.use_remove_padding=true" in packed and "packed (THD)" in packed
    # 2 key heads, 4 value heads: TP 4 splits the value heads but not the key heads; TP 8 neither.
    (tp4,) = layout_problems(arch, 4, 1, False)
    assert "tensor_model_parallel_size=4 does not divide linear_num_key_heads=2" in tp4
    assert len(layout_problems(arch, 8, 1, False)) == 2
    assert layout_problems(model_arch_from_plain(), 8, 4, True) == []


def model_arch_from_plain():
    from megatron_dapo.models.families import model_arch_from_hf

    return model_arch_from_hf(_plain_qwen3())


def test_unsupported_hybrid_configs_are_named():
    from megatron_dapo.models.families import UnsupportedModelError, model_arch_from_hf

    cfg = tiny_hybrid_config("qwen3_next").to_dict()
    with pytest.raises(UnsupportedModelError, match="linear_num_value_heads=3 is not a multiple"):
        model_arch_from_hf({**cfg, "linear_num_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="layer_types must name each of the 6 layers"):
        model_arch_from_hf({**cfg, "layer_types": ["sliding_attention"] * 6})


def test_the_run_gate_names_the_refused_pieces():
    """``plan_problems`` (``megatron-dapo check``, ``preflight`` and a run's start) reports ``layout_problems``: CP 2
    and packed sequences on 4 GPUs of a CUDA platform, TP 4 against 2 key heads on 4 more."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.plan import plan_problems
    from megatron_dapo.platform import make_platform
    from tests.config.test_run_validation import TINY

    arch = _arch("qwen3_5")
    cuda = make_platform("cuda")
    cp_packed = load_config(TINY, ["parallel.context_parallel_size=2", "actor.use_remove_padding=true"])
    found = plan_problems(cp_packed, arch, 4, cuda, probe_imports=False)
    assert any("context_parallel_size=2: qwen3_5's Gated DeltaNet layers" in p for p in found), found
    assert any(p.startswith("actor.use_remove_padding=true: qwen3_5's Gated DeltaNet") for p in found), found
    tp4 = plan_problems(
        load_config(TINY, ["parallel.tensor_model_parallel_size=4"]), arch, 8, cuda, probe_imports=False
    )
    assert any("does not divide linear_num_key_heads=2" in p for p in tp4), tp4
    plain = plan_problems(load_config(TINY, []), arch, 2, cuda, probe_imports=False)
    assert not any("Gated DeltaNet" in p for p in plain), plain


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_passes_the_converters_check(family, tmp_path):
    """A saved checkpoint (transformers' own names: the VLM's ``model.language_model.*``, ``lm_head.weight``,
    ``model.visual.*``; Qwen3-Next's per-expert tensors) passes the converter's strict header check: every mapped
    tensor there with its shape, nothing else but the ignored vision tower; its config.json gives the same arch."""
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings
    from megatron_dapo.weights.convert import check_hf_tensors
    from megatron_dapo.weights.loading import arch_mismatches
    from megatron_dapo.weights.safetensors_io import SafetensorsDir

    save_tiny_hybrid(family, tmp_path)
    arch = model_arch_from_hf(tmp_path)
    assert arch_mismatches(arch, _arch(family)) == []
    with SafetensorsDir(tmp_path) as reader:
        check_hf_tensors(reader, arch, param_mappings(arch))
        assert (family != "qwen3_next") == any(n.startswith("model.visual.") for n in reader.keys())


def test_packed_sequences_stay_off_by_default():
    """``actor.use_remove_padding`` unset turns packed sequences on where the attention takes them (TransformerEngine
    on CUDA), but not for a Gated DeltaNet model."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.plan import resolve
    from megatron_dapo.platform import make_platform
    from tests.config.test_run_validation import TINY

    cfg = load_config(TINY, ["model.transformer_impl=transformer_engine"])
    cuda = make_platform("cuda")
    assert resolve(cfg, model_arch_from_plain(), 2, cuda, probe_imports=False).use_remove_padding is True
    assert resolve(cfg, _arch("qwen3_5"), 2, cuda, probe_imports=False).use_remove_padding is False
