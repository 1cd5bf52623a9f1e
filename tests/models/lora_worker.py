"""torchrun worker: our LoRA (``megatron_dapo/models/lora.py``) on megatron-core ``GPTModel`` against HF transformers
with the same adapters, fp32, over one or more parallel layouts (the ``mcore_vs_hf_worker`` pattern and data).

For each layout each rank:
  1. builds the seeded tiny HF model and the Megatron chunks (HF weights loaded), runs the base model forward;
  2. ``apply_lora`` (rank ``RANK``): the untrained adapters (B = 0) must change no logit bit; then sets every adapter
     to full (TP=1) tensors drawn from its global layer name — A ``[rank, in]``, B ``[out, rank]`` — sliced to this
     rank's shards (column-parallel base: A split along the rank, B like the base weight's rows; row-parallel base:
     A like the base weight's columns, B along the output);
  3. DDP-wraps, runs ``forward_backward_func`` with the mean token NLL and ``finalize_model_grads``;
  4. HF reference with the same adapters in plain torch (peft's LoRA math: ``y + alpha/r * (x A^T) B^T``) hooked on
     q/k/v/o/gate/up/down_proj. A fused-layer adapter maps exactly: q/k/v_proj (gate/up_proj) share A, and their B's
     are the fused B's rows split as the fused weight is (``split_qkv`` / halves). Its gradients map back the same
     way (the fused A's gradient is the sum of the shared copies');
  5. records logits max|Δ| (last stage), loss, the relative error of every local adapter gradient, that base
     parameters have no gradient, ``adapters_enabled(False)`` vs the base logits, merge (logits vs unmerged) and
     unmerge (base weights back), and that ``state_dict`` keeps the base keys and reloads.
Each rank writes ``<out>/rank<r>.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import zlib
from functools import partial
from typing import Any

import torch

from tests.helpers.schedule import run_schedule
from tests.helpers.worker import write_rank_report
from tests.models.mcore_vs_hf_worker import (
    BATCH,
    SEQ,
    VOCAB,
    family_config_kwargs,
    make_micro_batches,
    parse_layout,
    rel_err,
    token_loss,
)
from tests.models.moe_vs_hf_worker import parse_layout as parse_moe_layout

RANK = 4
ALPHA = 8.0
FAMILY = "qwen2"  # qkv bias, tied embeddings
HF_NAMES = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}


def full_adapters(arch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{global Megatron module name: (A_full, B_full)} for every layer and target, drawn from the name."""
    h, hd = arch.hidden_size, arch.head_dim
    qkv_out = (arch.num_attention_heads + 2 * arch.num_query_groups) * hd
    shapes = {
        "self_attention.linear_qkv": (h, qkv_out),
        "self_attention.linear_proj": (arch.num_attention_heads * hd, h),
        "mlp.linear_fc1": (h, 2 * arch.ffn_hidden_size),
        "mlp.linear_fc2": (arch.ffn_hidden_size, h),
    }
    out = {}
    for layer in range(arch.num_layers):
        for sub, (n_in, n_out) in shapes.items():
            name = f"decoder.layers.{layer}.{sub}"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            out[name] = (torch.randn(RANK, n_in, generator=g) * 0.05, torch.randn(n_out, RANK, generator=g) * 0.05)
    return out


def local_shards(name: str, a: torch.Tensor, b: torch.Tensor, tp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's (A, B) shards of a full adapter (the module docstring of lora.py)."""
    from megatron_dapo.weights.layout import tp_shard

    name = name.split(".ep")[0]
    if name.endswith(("linear_proj", "linear_fc2", "out_proj")):  # row-parallel base
        return torch.chunk(a, tp, dim=1)[r], torch.chunk(b, tp, dim=0)[r]
    kind = "gate_up" if name.endswith("linear_fc1") else "copy"
    return torch.chunk(a, tp, dim=0)[r], tp_shard(b, kind, 0, tp, r)


def hf_adapters(full: dict, arch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our fused adapters as HF/peft per-projection adapters {hf module: (lora_A, lora_B)}."""
    from megatron_dapo.weights.layout import split_qkv

    out = {}
    for name, (a, b) in full.items():
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        if kind == "linear_qkv":
            bs = split_qkv(b, arch.num_query_groups, arch.head_dim, arch.heads_per_group)
        elif kind == "linear_fc1":
            bs = torch.chunk(b, 2, dim=0)
        else:
            bs = (b,)
        for hf_name, b_part in zip(HF_NAMES[kind], bs):
            out[f"model.layers.{layer}.{hf_name}"] = (
                a.clone().requires_grad_(True),
                b_part.clone().requires_grad_(True),
            )
    return out


def fused_grads(hf_ad: dict, full: dict, arch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF adapter gradients back on our fused layout: A = sum of the shared copies, B = fused rows."""
    from megatron_dapo.weights.layout import fuse_qkv

    out = {}
    for name in full:
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        parts = [hf_ad[f"model.layers.{layer}.{n}"] for n in HF_NAMES[kind]]
        ga = sum(p[0].grad for p in parts)
        gb = [p[1].grad for p in parts]
        if kind == "linear_qkv":
            out[name] = (ga, fuse_qkv(*gb, arch.num_query_groups, arch.head_dim))
        else:
            out[name] = (ga, torch.cat(gb, dim=0))
    return out


def hf_reference(hf, hf_ad: dict, dp_size: int, dp_rank: int) -> tuple[dict, dict]:
    """HF + LoRA (forward hooks): this DP rank's logits per micro-batch and losses; backward of the DP-mean loss."""
    scale = ALPHA / RANK
    handles = []
    for name, (a, b) in hf_ad.items():
        hook = partial(lambda m, inp, out, a, b: out + scale * (inp[0] @ a.T) @ b.T, a=a, b=b)
        handles.append(hf.get_submodule(name).register_forward_hook(hook))
    logits, losses, total = {}, {}, 0.0
    for d in range(dp_size):
        mbs = make_micro_batches(d)
        for mb in mbs:
            out = hf(input_ids=mb["ids"], attention_mask=mb["hf_mask"], position_ids=mb["pos"]).logits
            loss = token_loss(out, mb["targets"], mb["valid"])
            total = total + loss / (len(mbs) * dp_size)
            if d == dp_rank:
                logits[mb["index"]], losses[mb["index"]] = out.detach(), loss.item()
    total.backward()
    for handle in handles:
        handle.remove()
    return logits, losses


def run_model(model: list, mbs: list, forward_only: bool) -> tuple[dict, list]:
    """megatron-core's schedule over ``mbs``; full logits per micro-batch (last stage) and the reduced losses."""
    return run_schedule(model, mbs, VOCAB, SEQ, BATCH, token_loss, forward_only=forward_only)


def max_diff(a: dict, b: dict, mbs: list) -> float | None:
    if not a:
        return None
    return max((a[mb["index"]] - b[mb["index"]])[mb["valid"]].abs().max().item() for mb in mbs)


def set_adapters(chunks: list, full_of, tp: int, r: int) -> list[str]:
    """Copy this rank's shards of ``full_of(global name, adapter)`` = (A_full, B_full) into every wrapped layer;
    returns the global names set (experts: their local index, ``ep<rank>`` appended; expert TP is 1)."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.models.lora import LoRALinear

    names = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for sub, module in layer.named_modules():
                if isinstance(module, LoRALinear):
                    name = f"decoder.layers.{layer.layer_number - 1}.{sub}"
                    expert = module.adapter.is_expert
                    name += f".ep{ps.get_expert_model_parallel_rank()}" if expert else ""
                    a, b = local_shards(name, *full_of(name, module.adapter), 1 if expert else tp, 0 if expert else r)
                    with torch.no_grad():
                        module.adapter.linear_in.weight.copy_(a)
                        module.adapter.linear_out.weight.copy_(b)
                    names.append(name)
    return names


def random_full(name: str, adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (A, B) of ``adapter``'s base layer drawn from ``name`` (the same on every rank)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n_in, n_out = adapter.linear_in.input_size, adapter.linear_out.output_size
    return torch.randn(RANK, n_in, generator=g) * 0.05, torch.randn(n_out, RANK, generator=g) * 0.05


def adapter_grad_report(model: list, ref: dict, full: dict, tp: int, r: int) -> list[dict]:
    from megatron_dapo.models.builder import unwrap
    from megatron_dapo.models.lora import LoRALinear

    out = []
    for chunk in model:
        for layer in unwrap(chunk).decoder.layers:
            for sub, module in layer.named_modules():
                if not isinstance(module, LoRALinear):
                    continue
                name = f"decoder.layers.{layer.layer_number - 1}.{sub}"
                ga, gb = local_shards(name, *ref[name], tp, r)
                for which, param, want, scale in (
                    ("A", module.adapter.linear_in.weight, ga, ref[name][0]),
                    ("B", module.adapter.linear_out.weight, gb, ref[name][1]),
                ):
                    got = param.main_grad
                    out.append(
                        {
                            "name": f"{name}.{which}",
                            "rel_err": rel_err(got, want, scale),
                            "absmax": got.abs().max().item(),
                        }
                    )
    return out


def base_grad_report(model: list) -> dict[str, Any]:
    """Base parameters: frozen, no grad, no main_grad; adapter parameters: the only trainable ones."""
    leaked, adapters, frozen = [], 0, 0
    for chunk in model:
        for name, p in chunk.named_parameters():
            if ".adapter." in name:
                adapters += p.requires_grad
                continue
            frozen += 1
            if p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None:
                leaked.append(name)
    return {"leaked": leaked, "adapters_trainable": adapters, "base_params": frozen}


def merge_report(model: list, chunks: list, mbs: list, lora_logits: dict, forward=None) -> dict[str, Any]:
    """Merge, the merged model's logits (``forward(model)``; default: ``run_model`` forward-only) against the LoRA
    logits, unmerge."""
    from megatron_dapo.models.lora import lora_modules, merge_adapters, unmerge_adapters

    before = [m.to_wrap.weight.detach().clone() for m in lora_modules(chunks)]
    merged_count = merge_adapters(model)
    moved = max((m.to_wrap.weight - w).abs().max().item() for m, w in zip(lora_modules(chunks), before))
    merged_logits = forward(model) if forward is not None else run_model(model, mbs, True)[0]
    unmerge_adapters(model)
    restored = max((m.to_wrap.weight - w).abs().max().item() for m, w in zip(lora_modules(chunks), before))
    return {
        "merged": merged_count,
        "weights_moved": moved,
        "merged_vs_lora_logits": max_diff(merged_logits, lora_logits, mbs),
        "unmerge_max_abs": restored,
    }


def state_dict_report(chunks: list) -> dict[str, Any]:
    sd = chunks[0].state_dict()
    chunks[0].load_state_dict(sd, strict=True)
    return {
        "to_wrap_keys": sum("to_wrap" in k for k in sd),
        "base_qkv_key": any(k.endswith("self_attention.linear_qkv.weight") for k in sd),
        "adapter_keys": sum(".adapter.linear_" in k and k.endswith(".weight") for k in sd),
    }


def run_layout(cfg, dp_size: int, dp_rank: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dapo.config.schema import LoRAConfig
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.lora import adapters_enabled, apply_lora
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors

    hf = make_tiny_hf_model(FAMILY, seed=0, attn_implementation="eager", **family_config_kwargs(FAMILY))
    arch = model_arch_from_hf(hf.config.to_dict())
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    hf_params = dict(hf.named_parameters())
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [hf_params[n].detach() for n in m.hf], arch, padded))
    mbs = make_micro_batches(dp_rank)
    base_logits, _ = run_model(chunks, mbs, True)

    params = apply_lora(chunks, LoRAConfig(rank=RANK, alpha=ALPHA))
    untrained_logits, _ = run_model(chunks, mbs, True)
    full = full_adapters(arch)
    names = set_adapters(chunks, lambda name, _adapter: full[name], tp, r)
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()
    lora_logits, losses = run_model(model, mbs, False)
    finalize_model_grads(model)

    for p in hf.parameters():
        p.requires_grad_(False)
    hf_ad = hf_adapters(full, arch)
    hf_logits, hf_losses = hf_reference(hf, hf_ad, dp_size, dp_rank)
    with adapters_enabled(model, False):
        off_logits, _ = run_model(model, mbs, True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    return {
        "wrapped": sorted(names),
        "adapter_params": len(params),
        "untrained_vs_base": max_diff(untrained_logits, base_logits, mbs),
        "lora_vs_hf": max_diff(lora_logits, hf_logits, mbs),
        "lora_vs_base": max_diff(lora_logits, base_logits, mbs),
        "disabled_vs_base": max_diff(off_logits, base_logits, mbs),
        "losses": [[red["loss"].item(), hf_losses[mb["index"]]] for mb, red in zip(mbs, losses)] if last else [],
        "adapter_grads": adapter_grad_report(model, fused_grads(hf_ad, full, arch), full, tp, r),
        "base_grads": base_grad_report(model),
        "merge": merge_report(model, chunks, mbs, lora_logits),
        "state_dict": state_dict_report(chunks),
        "last_stage": last,
        "sequence_parallel": chunks[0].config.sequence_parallel,
    }


def run_moe_layout(cfg) -> dict[str, Any]:
    """qwen2_moe (SequentialMLP experts + a gated shared expert): every expert and shared-expert linear wrapped; no
    HF comparison (transformers fuses the experts' weights): the LoRA forward must equal the merged model's, whose
    forward ``test_models_moe`` compares with HF. Expert TP > 1 must be refused."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dapo.config.schema import LoRAConfig
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.lora import adapters_enabled, apply_lora
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, unfuse_hf_experts
    from megatron_dapo.weights.model_io import load_full_tensors

    hf = make_tiny_hf_model("qwen2_moe", seed=0, attn_implementation="eager")
    arch = model_arch_from_hf(hf.config.to_dict())
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    mbs = make_micro_batches(ps.get_data_parallel_rank())
    base_logits, _ = run_model(chunks, mbs, True)
    try:
        apply_lora(chunks, LoRAConfig(rank=RANK, alpha=ALPHA))
    except NotImplementedError as exc:
        return {"refused": str(exc)}
    untrained_logits, _ = run_model(chunks, mbs, True)
    names = set_adapters(chunks, random_full, tp, r)
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()
    lora_logits, _ = run_model(model, mbs, False)
    finalize_model_grads(model)
    grads = [(n, p.main_grad.abs().max().item()) for c in model for n, p in c.named_parameters() if ".adapter." in n]
    with adapters_enabled(model, False):
        off_logits, _ = run_model(model, mbs, True)
    return {
        "wrapped": sorted(names),
        "untrained_vs_base": max_diff(untrained_logits, base_logits, mbs),
        "lora_vs_base": max_diff(lora_logits, base_logits, mbs),
        "disabled_vs_base": max_diff(off_logits, base_logits, mbs),
        "zero_grad_adapters": sorted(n for n, g in grads if g == 0.0),
        "adapter_params": len(grads),
        "base_grads": base_grad_report(model),
        "merge": merge_report(model, chunks, mbs, lora_logits),
        "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
    }


def run_hybrid_layout(cfg) -> dict[str, Any]:
    """A tiny Qwen3.5 (``tests/models/qwen35_worker.py``: 5 Gated DeltaNet layers, 1 gated full-attention layer),
    ``all-linear``: each GDN layer's fused ``in_proj`` and ``out_proj`` and the attention layer's ``linear_qkv`` and
    ``linear_proj`` wrapped, every MLP's fc1/fc2. As for the MoE layouts, the LoRA forward must equal the merged
    model's, whose forward ``test_models_qwen35`` compares with HF at these layouts; the untrained adapters change
    nothing and every adapter gets a gradient."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dapo.config.schema import LoRAConfig
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.lora import adapters_enabled, apply_lora
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors
    from tests.models import qwen35_worker as q35

    hf = q35.tiny_hybrid_model("qwen3_5")
    arch = model_arch_from_hf(hf.config.to_dict())
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    weights = {n: p.detach() for n, p in hf.named_parameters()}
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    mbs = q35.make_micro_batches(ps.get_data_parallel_rank())

    def run(model: list, forward_only: bool) -> dict:
        logits, _ = run_schedule(
            model, mbs, q35.VOCAB, q35.SEQ, q35.BATCH, q35.token_loss, forward_only=forward_only, mask_key="mask"
        )
        return logits

    base_logits = run(chunks, True)
    apply_lora(chunks, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"]))
    untrained_logits = run(chunks, True)
    names = set_adapters(chunks, random_full, tp, r)
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()
    lora_logits = run(model, False)
    finalize_model_grads(model)
    grads = [(n, p.main_grad.abs().max().item()) for c in model for n, p in c.named_parameters() if ".adapter." in n]
    with adapters_enabled(model, False):
        off_logits = run(model, True)
    merge = merge_report(model, chunks, mbs, lora_logits, forward=lambda m: run(m, True))
    return {
        "wrapped": sorted(names),
        "linear_layers": list(arch.gated_delta_net.linear_layers),
        "untrained_vs_base": max_diff(untrained_logits, base_logits, mbs),
        "lora_vs_base": max_diff(lora_logits, base_logits, mbs),
        "disabled_vs_base": max_diff(off_logits, base_logits, mbs),
        "zero_grad_adapters": sorted(n for n, g in grads if g == 0.0),
        "adapter_params": len(grads),
        "adapter_numel": sum(p.numel() for c in model for n, p in c.named_parameters() if ".adapter." in n),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "base_grads": base_grad_report(model),
        "merge": merge,
        "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", required=True, help="comma-separated, e.g. tp2-pp1-sp,tp1-pp2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    report: dict[str, Any] = {"layouts": {}}
    info = None
    for name in args.layouts.split(","):
        moe, hybrid = name.startswith("moe-"), name.startswith("hybrid-")
        lay = parse_moe_layout(name[4:]) if moe else parse_layout(name[7:] if hybrid else name)
        overrides = [
            f"parallel.tensor_model_parallel_size={lay['tp']}",
            f"parallel.pipeline_model_parallel_size={lay['pp']}",
            f"parallel.sequence_parallel={str(lay['sp']).lower()}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
        ]
        if moe:
            overrides += [f"parallel.expert_model_parallel_size={lay['ep']}", "actor.moe_aux_loss_coeff=0"]
            overrides += [f"parallel.expert_tensor_parallel_size={lay['etp']}"] if lay["etp"] else []
        cfg = load_config(None, overrides)
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        if moe:
            entry = run_moe_layout(cfg)
        elif hybrid:
            entry = run_hybrid_layout(cfg)
        else:
            entry = run_layout(cfg, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
        entry.update(
            rank=info.rank, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank()
        )
        report["layouts"][name] = entry
        destroy_model_parallel()
    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
