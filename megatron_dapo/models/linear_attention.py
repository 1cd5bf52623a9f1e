"""Qwen3-Next / Qwen3.5 hybrids on megatron-core: Gated DeltaNet layers between gated full-attention layers.

The ``TransformerConfig`` fields (``experimental_attention_variant="gated_delta_net"``, the per-layer
``linear_attention_freq``, ``attention_output_gate``, zero-centred norms) and the local spec's per-layer swap: a
linear layer's ``self_attention`` becomes megatron-core's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py``)
and every RMSNorm scales by ``1 + w`` as HF's ``Qwen3NextRMSNorm`` does. What maps how: docs/qwen35.md.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from megatron_dapo.models.families import ModelArch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """HF's ``Qwen3NextRMSNorm``: ``x / rms(x) · (1 + w)`` in fp32, cast back (megatron-core's
    ``layernorm_zero_centered_gamma``; the weight starts at zero). ``sequence_parallel`` on the weight as
    ``builder.RMSNorm`` has it (its gradient is all-reduced over TP when SP splits the tokens)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class ZeroCenteredHeadRMSNorm(ZeroCenteredRMSNorm):
    """The per-head norms (q/k norms, the Gated DeltaNet's output norm): they act on TP-split heads, so their weight
    is not sequence-parallel."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


class GatedDeltaNetOutNorm(ZeroCenteredHeadRMSNorm):
    """The Gated DeltaNet's output norm. Its weight is replicated over TP while each rank normalises only its value
    heads, so its gradient is a sum over the TP ranks; megatron-core 0.16.1's ``finalize_model_grads`` reduces only
    sequence-parallel weights and the q/k norms (by name), not this one. The weight therefore enters the forward
    through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward): every rank gets the
    whole gradient, as an unsplit layer would."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps)
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        self._tp_copy = copy_to_tensor_model_parallel_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self._tp_copy(self.weight).float())).to(x.dtype)


def linear_attention_config_kwargs(arch: ModelArch) -> dict:
    """``TransformerConfig`` fields of a hybrid ``arch`` (none for other models). The layer pattern is passed as a
    list (1 = Gated DeltaNet), so HF ``layer_types`` of any shape carry over, and a layer count that is not a
    multiple of the full-attention interval too."""
    gdn = arch.gated_delta_net
    if gdn is None:
        return {}
    return {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": arch.linear_attention_freq,
        "linear_conv_kernel_dim": gdn.conv_kernel_dim,
        "linear_key_head_dim": gdn.key_head_dim,
        "linear_value_head_dim": gdn.value_head_dim,
        "linear_num_key_heads": gdn.num_key_heads,
        "linear_num_value_heads": gdn.num_value_heads,
        "attention_output_gate": arch.attention_output_gate,
        "layernorm_zero_centered_gamma": arch.zero_centered_norms,
    }


def hybrid_block_spec(arch: ModelArch, config, vp_stage: Optional[int], impl: str, block=None):
    """This chunk's layer specs of a hybrid model.

    TransformerEngine: megatron-core's ``get_transformer_block_with_experimental_attention_variant_spec`` (TE norms
    take ``layernorm_zero_centered_gamma`` from the config) with ``GatedDeltaNetOutNorm`` as the GDN's output norm
    (not run here: no TE on CPU). Local spec: ``block`` is the chunk's per-layer specs as
    ``builder.moe_layer_specs`` makes them (dense or MoE MLP, the HF-exact norms, the chosen core attention); each
    linear layer's ``self_attention`` becomes ``GatedDeltaNet`` with plain column/row-parallel projections, and every
    norm becomes zero-centred."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if impl == "transformer_engine":
        block = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
        for spec in block.layer_specs:  # TENorm reduces its gradient over TP only with SP on: GatedDeltaNetOutNorm
            attention = spec.submodules.self_attention
            if getattr(attention.submodules, "out_norm", None) is not None:
                attention.submodules.out_norm = GatedDeltaNetOutNorm
        return block
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [_hybrid_layer(arch, spec, offset + i) for i, spec in enumerate(block.layer_specs)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)


def _hybrid_layer(arch: ModelArch, spec, layer: int):
    """One local-spec layer made hybrid (a copy: the specs of several layers may be one object)."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if not arch.is_linear_layer(layer):
        sub.self_attention.submodules.q_layernorm = ZeroCenteredHeadRMSNorm
        sub.self_attention.submodules.k_layernorm = ZeroCenteredHeadRMSNorm
        return spec
    sub.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedDeltaNetOutNorm, out_proj=RowParallelLinear
        ),
    )
    # Checkpoint keys as the TE spec writes them (its in_proj fuses the input norm: megatron-core's hybrid spec).
    keys = {k: v for k, v in sub.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    sub.sharded_state_dict_keys_map = keys
    return spec
