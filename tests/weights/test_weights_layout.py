"""The layout module against hand-built examples and megatron-core's own pipeline split."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.models.families import ParamMapping, model_arch_from_hf, param_mappings
from megatron_dapo.testing.tiny_models import tiny_hf_config
from megatron_dapo.weights.layout import (
    fuse_qkv,
    global_to_local_name,
    hf_to_mcore,
    layer_of,
    local_to_global_name,
    mcore_to_hf,
    pad_vocab,
    padded_vocab_size,
    pp_layer_range,
    split_qkv,
    tp_merge,
    tp_shard,
    unpad_vocab,
)


def test_fuse_qkv_hand_example_and_inverse():
    # 4 query heads in 2 groups, head_dim 2: rows named by value.
    q = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7])
    k = torch.tensor([100.0, 101, 102, 103])
    v = torch.tensor([200.0, 201, 202, 203])
    fused = fuse_qkv(q, k, v, num_query_groups=2, head_dim=2)
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3 then k1 then v1
    expected = torch.tensor([0.0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203])
    assert torch.equal(fused, expected)
    q2, k2, v2 = split_qkv(fused, num_query_groups=2, head_dim=2, heads_per_group=2)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    # TP=2 splits by group: rank 1's shard is group 1 and splits into that group's q, k, v.
    shard = tp_shard(fused, "qkv", 0, 2, 1)
    q1, k1, v1 = split_qkv(shard, num_query_groups=1, head_dim=2, heads_per_group=2)
    assert torch.equal(q1, q[4:]) and torch.equal(k1, k[2:]) and torch.equal(v1, v[2:])


def test_fuse_split_qkv_inverse_on_weights():
    g = torch.Generator().manual_seed(0)
    for groups, heads, hd in [(2, 4, 16), (1, 4, 8), (4, 4, 8), (2, 8, 4)]:
        q = torch.randn(heads * hd, 32, generator=g)
        k = torch.randn(groups * hd, 32, generator=g)
        v = torch.randn(groups * hd, 32, generator=g)
        fused = fuse_qkv(q, k, v, groups, hd)
        assert fused.shape == ((heads + 2 * groups) * hd, 32)
        out = split_qkv(fused, groups, hd, heads // groups)
        for a, b in zip(out, (q, k, v)):
            assert torch.equal(a, b)


def test_gate_up_tp_shard_and_merge_hand_example():
    gate = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    up = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    mapping = ParamMapping("decoder.layers.0.mlp.linear_fc1.weight", ("g", "u"), "gate_up", 0, 0)
    arch = model_arch_from_hf(tiny_hf_config("qwen2").to_dict())
    full = hf_to_mcore(mapping, [gate, up], arch, padded_vocab=128)
    assert full.flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    r0, r1 = (tp_shard(full, "gate_up", 0, 2, r) for r in range(2))
    assert r0.flatten().tolist() == [0, 1, 10, 11]
    assert r1.flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(tp_merge([r0, r1], "gate_up", 0), full)
    back = mcore_to_hf(mapping, full, arch)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_tp_shard_merge_inverse_for_every_parameter():
    g = torch.Generator().manual_seed(1)
    for family in ("qwen2", "qwen3", "llama"):
        arch = model_arch_from_hf(tiny_hf_config(family).to_dict())
        for m in param_mappings(arch):
            shape = (256, 64) if m.kind == "vocab" else (96, 64) if m.tp_dim is not None else (64,)
            full = torch.randn(shape, generator=g)
            for tp in (1, 2):
                shards = [tp_shard(full, m.kind, m.tp_dim, tp, r) for r in range(tp)]
                assert torch.equal(tp_merge(shards, m.kind, m.tp_dim), full), (m.mcore, tp)


def test_vocab_padding():
    assert padded_vocab_size(100, 128, 1) == 128
    assert padded_vocab_size(100, 128, 2) == 256
    assert padded_vocab_size(151936, 128, 2) == 152064  # Qwen2's vocabulary: 1187 x 128 is odd, so one more row block
    assert padded_vocab_size(32000, 128, 2) == 32000
    t = torch.randn(100, 4)
    p = pad_vocab(t, 256)
    assert p.shape == (256, 4) and torch.equal(p[:100], t) and not p[100:].any()
    assert torch.equal(unpad_vocab(p, 100), t)
    with pytest.raises(ValueError, match="exceed padded size"):
        pad_vocab(t, 64)


@pytest.mark.parametrize(
    "num_layers,pp,vpp", [(4, 2, None), (8, 4, None), (8, 2, 2), (12, 3, 2), (16, 2, 4), (6, 1, None)]
)
def test_pp_layer_range_matches_megatron_core(num_layers, pp, vpp):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    covered = []
    for rank in range(pp):
        for stage in range(vpp or 1):
            vp = stage if vpp else None
            rng = pp_layer_range(num_layers, pp, rank, vpp, stage)
            assert rng.start == get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=rank)
            assert len(rng) == get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=rank)
            covered += list(rng)
    assert sorted(covered) == list(range(num_layers))


def test_pp_layer_range_hand_example_with_virtual_stages():
    # 8 layers, PP=2, VPP=2: chunks of 2 layers dealt round-robin over the pipeline ranks.
    assert [list(pp_layer_range(8, 2, r, 2, v)) for v in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(pp_layer_range(8, 2, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="not divisible"):
        pp_layer_range(6, 4, 0)


def test_layer_names():
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert local_to_global_name(name, 4) == "decoder.layers.5.mlp.linear_fc1.weight"
    assert global_to_local_name("decoder.layers.5.mlp.linear_fc1.weight", 4) == name
    assert layer_of("decoder.layers.12.input_layernorm.weight") == 12
    assert layer_of("embedding.word_embeddings.weight") is None
    assert local_to_global_name("output_layer.weight", 4) == "output_layer.weight"
