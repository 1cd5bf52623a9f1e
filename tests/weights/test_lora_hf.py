"""weights/lora_hf.py: Megatron LoRA adapters → peft names and tensors, by hand-computed examples."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.testing.tiny_models import tiny_hf_config
from megatron_dapo.weights.layout import fuse_qkv, split_qkv
from megatron_dapo.weights.lora_hf import (
    mcore_adapters_to_peft,
    peft_adapter_config,
    peft_target_modules,
    peft_to_mcore_adapters,
)

R = 4
L = "decoder.layers.3."
P = "base_model.model.model.layers.3."


def _arch(family: str = "qwen2", **kw):
    return model_arch_from_hf(tiny_hf_config(family, **kw).to_dict())


def _dense_adapters(arch, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd = arch.hidden_size, arch.head_dim
    qkv_out = (arch.num_attention_heads + 2 * arch.num_query_groups) * hd
    shapes = {
        "self_attention.linear_qkv": (qkv_out, h),
        "self_attention.linear_proj": (h, arch.num_attention_heads * hd),
        "mlp.linear_fc1": (2 * arch.ffn_hidden_size, h),
        "mlp.linear_fc2": (h, arch.ffn_hidden_size),
    }
    out = {}
    for module, (n_out, n_in) in shapes.items():
        out[f"{L}{module}.adapter.linear_in.weight"] = torch.randn(R, n_in, generator=g)
        out[f"{L}{module}.adapter.linear_out.weight"] = torch.randn(n_out, R, generator=g)
    return out


def test_target_modules_and_config():
    arch = _arch()
    assert peft_target_modules(arch, ["all-linear"]) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert peft_target_modules(arch, ["linear_fc2", "linear_qkv"]) == ["q_proj", "k_proj", "v_proj", "down_proj"]
    with pytest.raises(ValueError, match="linear_q"):
        peft_target_modules(arch, ["linear_q"])
    cfg = peft_adapter_config(arch, LoRAConfig(rank=8, alpha=16.0, target_modules=["linear_proj"]), "/m")
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (8, 16, 0.0)
    assert isinstance(cfg["lora_alpha"], int)
    assert cfg["target_modules"] == ["o_proj"] and cfg["base_model_name_or_path"] == "/m"
    assert cfg["bias"] == "none" and cfg["fan_in_fan_out"] is False and cfg["use_rslora"] is False
    assert peft_adapter_config(arch, LoRAConfig(rank=4, alpha=2.5))["lora_alpha"] == 2.5
    with pytest.raises(ValueError, match="off"):
        peft_adapter_config(arch, LoRAConfig(rank=0))


def test_vllm_peft_helper_accepts_config():
    from vllm.config.lora import LoRAConfig as VllmLoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    cfg = peft_adapter_config(_arch(), LoRAConfig(rank=8, alpha=16.0))
    helper = PEFTHelper.from_dict(cfg)
    helper.validate_legal(VllmLoRAConfig(max_lora_rank=8))
    assert helper.vllm_lora_scaling_factor == 2.0


def test_qkv_split_reproduces_fused_delta():
    """s·B_q·A (etc.) equals the q rows of s·B_qkv·A under split_qkv, and names are peft's."""
    arch = _arch()  # 4 heads in 2 groups, head_dim 16
    g = torch.Generator().manual_seed(0)
    adapters = _dense_adapters(arch, g)
    peft = dict(mcore_adapters_to_peft(arch, adapters.items()))
    expected_names = {
        f"{P}{mod}.lora_{ab}.weight"
        for mod in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
        for ab in "AB"
    }
    assert set(peft) == expected_names
    s = 2.0
    a = adapters[f"{L}self_attention.linear_qkv.adapter.linear_in.weight"]
    b = adapters[f"{L}self_attention.linear_qkv.adapter.linear_out.weight"]
    fused_delta = s * b @ a
    dq, dk, dv = split_qkv(fused_delta, arch.num_query_groups, arch.head_dim, arch.heads_per_group)
    for proj, want in (("q", dq), ("k", dk), ("v", dv)):
        got_a, got_b = peft[f"{P}self_attn.{proj}_proj.lora_A.weight"], peft[f"{P}self_attn.{proj}_proj.lora_B.weight"]
        assert torch.equal(got_a, a)
        torch.testing.assert_close(s * got_b @ got_a, want, rtol=0, atol=1e-5)
    assert peft[f"{P}self_attn.q_proj.lora_B.weight"].shape == (arch.num_attention_heads * arch.head_dim, R)
    assert peft[f"{P}self_attn.k_proj.lora_B.weight"].shape == (arch.num_query_groups * arch.head_dim, R)
    # Hand example of the row order: group 0 = [q0, q1, k0, v0] (head_dim 16 rows each), group 1 after it.
    hd = arch.head_dim
    assert torch.equal(peft[f"{P}self_attn.k_proj.lora_B.weight"][:hd], b[2 * hd : 3 * hd])
    assert torch.equal(peft[f"{P}self_attn.v_proj.lora_B.weight"][hd:], b[7 * hd : 8 * hd])
    assert torch.equal(peft[f"{P}self_attn.q_proj.lora_B.weight"][2 * hd :], b[4 * hd : 6 * hd])


def test_fc1_and_row_parallel_layers():
    arch = _arch()
    g = torch.Generator().manual_seed(1)
    adapters = _dense_adapters(arch, g)
    peft = dict(mcore_adapters_to_peft(arch, adapters.items()))
    b = adapters[f"{L}mlp.linear_fc1.adapter.linear_out.weight"]
    ffn = arch.ffn_hidden_size
    assert torch.equal(peft[f"{P}mlp.gate_proj.lora_B.weight"], b[:ffn])
    assert torch.equal(peft[f"{P}mlp.up_proj.lora_B.weight"], b[ffn:])
    for mcore, hf in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
        assert torch.equal(peft[f"{P}{hf}.lora_A.weight"], adapters[f"{L}{mcore}.adapter.linear_in.weight"])
        assert torch.equal(peft[f"{P}{hf}.lora_B.weight"], adapters[f"{L}{mcore}.adapter.linear_out.weight"])
    back = dict(peft_to_mcore_adapters(arch, peft))
    assert set(back) == set(adapters)
    for name, t in adapters.items():
        assert torch.equal(back[name], t), name


def test_inverse_refuses_unequal_shared_a_and_unknown():
    arch = _arch()
    peft = dict(mcore_adapters_to_peft(arch, _dense_adapters(arch, torch.Generator().manual_seed(2)).items()))
    peft[f"{P}self_attn.k_proj.lora_A.weight"] = peft[f"{P}self_attn.k_proj.lora_A.weight"] + 1.0
    with pytest.raises(ValueError, match="lora_A of .*differ"):
        dict(peft_to_mcore_adapters(arch, peft))
    del peft[f"{P}self_attn.k_proj.lora_A.weight"]
    with pytest.raises(ValueError, match="missing"):
        dict(peft_to_mcore_adapters(arch, peft))


def test_unmapped_names_raise_naming_the_tensor():
    arch = _arch()
    a = torch.zeros(R, arch.hidden_size)
    bad = "decoder.layers.3.self_attention.linear_qkv.adapter.linear_mid.weight"
    with pytest.raises(KeyError, match="linear_mid"):
        list(mcore_adapters_to_peft(arch, [(bad, a)]))
    bad = f"decoder.layers.{arch.num_layers}.mlp.linear_fc2.adapter.linear_in.weight"
    with pytest.raises(KeyError, match=f"layers.{arch.num_layers}.mlp.linear_fc2"):
        list(mcore_adapters_to_peft(arch, [(bad, a)]))
    bad = "embedding.word_embeddings.adapter.linear_in.weight"
    with pytest.raises(KeyError, match="word_embeddings"):
        list(mcore_adapters_to_peft(arch, [(bad, a)]))


def test_moe_experts_and_shared_expert():
    arch = _arch("qwen2_moe")
    assert arch.moe_shared_expert_ffn_hidden_size and arch.is_moe_layer(3)
    g = torch.Generator().manual_seed(3)
    ffn, sffn, h = arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size, arch.hidden_size
    e = arch.num_experts - 1
    x = f"{L}mlp.experts.local_experts.{e}."
    s = f"{L}mlp.shared_experts."
    adapters = {
        f"{x}linear_fc1.adapter.linear_in.weight": torch.randn(R, h, generator=g),
        f"{x}linear_fc1.adapter.linear_out.weight": torch.randn(2 * ffn, R, generator=g),
        f"{x}linear_fc2.adapter.linear_in.weight": torch.randn(R, ffn, generator=g),
        f"{s}linear_fc1.adapter.linear_out.weight": torch.randn(2 * sffn, R, generator=g),
    }
    peft = dict(mcore_adapters_to_peft(arch, adapters.items()))
    b = adapters[f"{x}linear_fc1.adapter.linear_out.weight"]
    assert torch.equal(peft[f"{P}mlp.experts.{e}.gate_proj.lora_B.weight"], b[:ffn])
    assert torch.equal(peft[f"{P}mlp.experts.{e}.up_proj.lora_B.weight"], b[ffn:])
    assert torch.equal(
        peft[f"{P}mlp.experts.{e}.gate_proj.lora_A.weight"], adapters[f"{x}linear_fc1.adapter.linear_in.weight"]
    )
    assert f"{P}mlp.experts.{e}.down_proj.lora_A.weight" in peft
    sb = adapters[f"{s}linear_fc1.adapter.linear_out.weight"]
    assert torch.equal(peft[f"{P}mlp.shared_expert.up_proj.lora_B.weight"], sb[sffn:])
    with pytest.raises(KeyError, match="router"):
        list(mcore_adapters_to_peft(arch, [(f"{L}mlp.router.adapter.linear_in.weight", torch.zeros(R, h))]))


def test_fuse_round_trip_on_kv_rows():
    """B rows built with fuse_qkv from per-projection B's come back unchanged."""
    arch = _arch("qwen3")
    g = torch.Generator().manual_seed(4)
    hd, grp = arch.head_dim, arch.num_query_groups
    bq = torch.randn(arch.num_attention_heads * hd, R, generator=g)
    bk, bv = torch.randn(grp * hd, R, generator=g), torch.randn(grp * hd, R, generator=g)
    a = torch.randn(R, arch.hidden_size, generator=g)
    fused = fuse_qkv(bq, bk, bv, grp, hd)
    names = (
        f"{L}self_attention.linear_qkv.adapter.linear_in.weight",
        f"{L}self_attention.linear_qkv.adapter.linear_out.weight",
    )
    peft = dict(mcore_adapters_to_peft(arch, [(names[0], a), (names[1], fused)]))
    for proj, want in zip("qkv", (bq, bk, bv)):
        assert torch.equal(peft[f"{P}self_attn.{proj}_proj.lora_B.weight"], want)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_gated_delta_net_in_proj_splits_like_its_base_weight(family):
    """A hybrid's fused Gated DeltaNet in_proj adapter: the HF projections (Qwen3.5's in_proj_qkv/z/b/a, Qwen3-Next's
    grouped in_proj_qkvz/ba) share A, and s·B_i·A is the i-th HF piece of the fused s·B·A as the base weight's own
    layout map splits it (weights/layout.mcore_to_hf); out_proj as it is; and back, exactly."""
    from megatron_dapo.models.families import param_mappings
    from megatron_dapo.weights.layout import mcore_to_hf
    from tests.models.qwen35_worker import tiny_hybrid_config

    arch = model_arch_from_hf(tiny_hybrid_config(family).to_dict())
    gdn = arch.gated_delta_net
    layer = gdn.linear_layers[0]
    prefix = f"decoder.layers.{layer}.self_attention."
    g = torch.Generator().manual_seed(3)
    h = arch.hidden_size
    adapters = {
        f"{prefix}in_proj.adapter.linear_in.weight": torch.randn(R, h, generator=g),
        f"{prefix}in_proj.adapter.linear_out.weight": torch.randn(sum(gdn.in_proj_sections), R, generator=g),
        f"{prefix}out_proj.adapter.linear_in.weight": torch.randn(R, gdn.v_dim, generator=g),
        f"{prefix}out_proj.adapter.linear_out.weight": torch.randn(h, R, generator=g),
    }
    peft = dict(mcore_adapters_to_peft(arch, adapters.items()))
    (in_map,) = [m for m in param_mappings(arch) if m.mcore == f"{prefix}in_proj.weight"]
    a, b = adapters[f"{prefix}in_proj.adapter.linear_in.weight"], adapters[f"{prefix}in_proj.adapter.linear_out.weight"]
    pieces = mcore_to_hf(in_map, 2.0 * b @ a, arch)
    assert len(pieces) == len(in_map.hf) == (2 if family == "qwen3_next" else 4)
    for hf, want in zip(in_map.hf, pieces):
        module = "base_model.model." + hf[: -len(".weight")]
        got_a, got_b = peft[f"{module}.lora_A.weight"], peft[f"{module}.lora_B.weight"]
        assert torch.equal(got_a, a)
        torch.testing.assert_close(2.0 * got_b @ got_a, want, rtol=0, atol=1e-5)
    back = dict(peft_to_mcore_adapters(arch, peft))
    assert set(back) == set(adapters) and all(torch.equal(back[n], t) for n, t in adapters.items())
    names = peft_target_modules(arch, ["all-linear"])
    gdn_names = ["in_proj_qkvz", "in_proj_ba"] if family == "qwen3_next" else ["in_proj_qkv", "in_proj_z", "in_proj_b"]
    assert set(gdn_names + ["out_proj", "q_proj", "o_proj", "down_proj"]) <= set(names)
    assert peft_target_modules(_arch(), ["all-linear"]) == ["q_proj", "k_proj", "v_proj", "o_proj"] + [
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
