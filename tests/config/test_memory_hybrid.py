"""The memory plan of a hybrid (Qwen3-Next / Qwen3.5, Gated DeltaNet + gated full attention): its parameter counts
against transformers' own models and the layout map's TP shards, and vLLM's recurrent state per sequence against
vLLM's own state-shape rule, in the KV cache the plan reports."""

from __future__ import annotations

import math

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.config.memory import (
    actor_stage_params,
    kv_cache,
    param_counts,
    recurrent_state_bytes,
    stage_layers,
)
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import is_ignorable_hf_name, model_arch_from_hf, param_mappings
from megatron_dapo.platform import make_platform
from megatron_dapo.weights.layout import hf_shapes
from tests.config.test_memory_model import BASE, GIB, TINY
from tests.models.qwen35_worker import FAMILIES, tiny_hybrid_config, tiny_hybrid_model

BF16 = 2


def _arch(family: str):
    return model_arch_from_hf(tiny_hybrid_config(family).to_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_param_counts_match_the_hf_text_model(family):
    # transformers' model, less the vision tower and the MTP head the text model does not hold: the Gated DeltaNet
    # layers' projections, conv1d, A_log, dt_bias and gated norm, and the attention's output-gate rows in q_proj.
    arch = _arch(family)
    model = tiny_hybrid_model(family)
    text = sum(p.numel() for n, p in model.named_parameters() if not is_ignorable_hf_name(arch, n))
    assert param_counts(arch).total == text


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_hybrid_stage_params_equal_the_layout_maps_shards(family, tp, pp):
    # Each pipeline stage's decoder layers as the weight map shards them (a tensor with a TP dimension / TP, the
    # others whole), plus the final norm on the last stage; the vocabulary is left out (padded_vocab 0).
    arch = _arch(family)
    counts = param_counts(arch)
    for stage in range(pp):
        layers = {i for chunk in stage_layers(arch.num_layers, pp, None, stage) for i in chunk}
        expect = 0
        for m in param_mappings(arch):
            if m.layer in layers:
                numel = sum(math.prod(s) for s in hf_shapes(m, arch))
                expect += numel // tp if m.tp_dim is not None else numel
        expect += arch.hidden_size if stage == pp - 1 else 0
        assert sum(actor_stage_params(arch, counts, tp, pp, 0, stage=stage)) == expect, (stage, layers)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_recurrent_state_is_vllms_gated_delta_net_state(family, rollout_tp):
    # vLLM sizes each linear-attention layer's cache entry with MambaStateShapeCalculator (conv state and temporal
    # state, split over its TP), in the model dtype under mamba_ssm_cache_dtype=auto.
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator  # heavy: vLLM

    arch = _arch(family)
    g = arch.gated_delta_net
    conv, temporal = MambaStateShapeCalculator.gated_delta_net_state_shape(
        rollout_tp, g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel_dim
    )
    per_layer = (math.prod(conv) + math.prod(temporal)) * BF16
    assert recurrent_state_bytes(arch, rollout_tp, BF16) == len(g.linear_layers) * per_layer


def test_hybrid_kv_cache_holds_attention_layers_and_each_sequences_state():
    # qwen3_5 tiny: 6 layers, 5 of them Gated DeltaNet, so K and V live in 1 layer: 2 x 1 x 2 KV heads / rollout TP 2
    # x head_dim 16 x 2 B = 64 B per token; each sequence's state at rollout TP 2 is 5 layers x (96 / 2 conv channels
    # x 3 + 4 / 2 value heads x head_v 8 x head_k 16) x 2 B = 4000 B. A sequence of 96 + 32 tokens takes 4000 +
    # 128 x 64 B.
    arch = _arch("qwen3_5")
    short = ["data.max_prompt_length=96", "data.max_response_length=32"]
    cfg = load_config(TINY, BASE + short + ["parallel.platform=cpu", "rollout.kv_cache_memory_mb=1"])
    plan = resolve(cfg, arch, 8, make_platform("cpu"), probe_imports=False)
    kv = kv_cache(plan, arch, cfg.rollout, None)
    assert (kv.bytes_per_token, kv.state_bytes_per_seq) == (64, 4000)
    assert kv.tokens == 2**20 // (4000 + 128 * 64) * 128 == 86 * 128
    # On a device the cache's share is what vLLM's rule leaves; the state still takes its place per sequence.
    cuda = load_config(TINY, BASE + short)
    plan = resolve(cuda, arch, 8, make_platform("cuda"), probe_imports=False)
    on_device = kv_cache(plan, arch, cuda.rollout, GIB)
    assert on_device.tokens == int(on_device.size // (4000 + 128 * 64)) * 128 > 0
