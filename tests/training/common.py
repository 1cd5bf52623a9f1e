"""Shared by the training workers: a tiny actor built the trainer's way, and views into megatron-core optimizers."""

from __future__ import annotations

import zlib
from typing import Any

import torch

# Tiny Qwen2 (its qkv biases exercise megatron-core's "no weight decay on biases and 1-D params" grouping).
ARCH_KWARGS = dict(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)


def tiny_arch():
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    return model_arch_from_hf(tiny_hf_config("qwen2", **ARCH_KWARGS).to_dict())


def build_actor(params_dtype: str, dist_opt: bool, tp: int = 1, extra: tuple[str, ...] = ()):
    """(cfg, wrapped chunks) on the current world, after (re-)initialising megatron-core's parallel state."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.parallel import init_distributed, init_model_parallel

    cfg = load_config(
        None,
        [
            f"model.params_dtype={params_dtype}",
            f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
            f"parallel.tensor_model_parallel_size={tp}",
            "parallel.platform=cpu",
            *extra,
        ],
    )
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    return cfg, wrap_for_training(build_gpt_chunks(tiny_arch(), cfg.model, cfg.parallel, cfg.actor), cfg.parallel)


def named_params(chunks: list) -> list[tuple[str, torch.nn.Parameter]]:
    """(chunk-qualified name, parameter) of the unwrapped GPTModels, in a stable order."""
    from megatron_dapo.models.builder import unwrap

    return [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in unwrap(c).named_parameters()]


def main_param_views(optimizer) -> dict[Any, tuple[torch.Tensor, dict, slice]]:
    """model parameter -> (main parameter the optimizer updates, its torch optimizer state, the flat slice of the
    model parameter it covers). The main parameter is fp32: the parameter itself (fp32), its fp32 copy (bf16), or a
    DP shard of either (distributed optimizer)."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if isinstance(opt, DistributedOptimizer):
            for model_param, (g, i) in opt.model_param_group_index_map.items():
                main = inner.param_groups[g]["params"][i]
                r = opt._get_model_param_range_map(model_param)["param"]
                out[model_param] = (main, inner.state.get(main, {}), slice(r.start, r.end))
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            for g, group in enumerate(opt.float16_groups):
                for i, model_param in enumerate(group):
                    main = opt.fp32_from_float16_groups[g][i]
                    out[model_param] = (main, inner.state.get(main, {}), slice(0, model_param.numel()))
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    out[p] = (p, inner.state.get(p, {}), slice(0, p.numel()))
    return out


def name_seed(name: str, *salt: int) -> int:
    """A seed that depends on the parameter's name only (so TP-replicated parameters get the same values)."""
    return (zlib.crc32(name.encode()) + 7919 * sum((k + 1) * s for k, s in enumerate(salt))) % (2**31)
