"""torchrun worker: Qwen3-MoE in megatron-core (our builder, name map and CPU shims) against HF transformers.

For every layout (``ep<E>-tp<T>-pp<P>[-sp]``; DP = world / (TP x PP), expert-DP = world / (ETP x EP x PP)) each rank:
  1. builds the seeded tiny HF model of each MoE family (``make_tiny_hf_model``: layer 0 dense, layers 1-3 MoE with
     8 experts, top-2; qwen3_moe renormalises the top-k, qwen2_moe does not and adds a gated shared expert) in fp32
     (logit reference) and a float64 copy (gradient reference);
  2. builds the Megatron chunks with ``build_gpt_chunks``, loads the HF weights through the name map
     (``local_param_table`` gives each EP rank its experts) and wraps them with ``wrap_for_training``;
  3. runs ``forward_backward_func`` over two micro-batches (a plain one shared by all DP ranks, a left-padded one
     per DP rank; tokens of different DP ranks meet in the experts through the alltoall dispatcher) with a mean
     token NLL, then ``finalize_model_grads`` (dense grads averaged over DP, expert grads over expert-DP);
  4. records logits max|diff| vs HF fp32 on the non-pad positions (last stage), every local parameter's gradient
     relative error (max-abs and Frobenius) vs the float64 HF gradient of mean_DP(mean_mb(NLL)), and per MoE
     layer which global experts
     this rank holds.
Writes ``<out>/rank<r>.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import copy
import re
import time
from typing import Any

import torch

from tests.helpers.schedule import run_schedule
from tests.helpers.worker import write_rank_report
from tests.models.mcore_vs_hf_worker import BATCH, SEQ, VOCAB, make_micro_batches, token_loss

HF_SEED = 0
FAMILIES = ("qwen3_moe", "qwen2_moe")


def parse_layout(name: str) -> dict[str, Any]:
    """``ep2-tp2-pp1-etp1-sp`` -> sizes (ETP: expert tensor parallel size, default TP)."""
    match = re.fullmatch(r"ep(\d+)-tp(\d+)-pp(\d+)(?:-etp(\d+))?(-sp)?", name)
    if match is None:
        raise ValueError(f"layout {name!r}: expected ep<N>-tp<N>-pp<N>[-etp<N>][-sp]")
    ep, tp, pp, etp, sp = match.groups()
    return {"ep": int(ep), "tp": int(tp), "pp": int(pp), "etp": int(etp) if etp else None, "sp": sp is not None}


def unpadded_loss(hf, mb: dict) -> torch.Tensor:
    """``token_loss`` of a left-padded micro-batch, each row run on its valid suffix alone (positions 0..n-1, as in
    the padded run). transformers' float64 eager path turns fully masked pad rows into NaN, which then reach the
    loss as 0 x NaN; without the pad tokens there is nothing to mask."""
    total = 0.0
    for row in range(mb["ids"].shape[0]):
        valid = mb["valid"][row]
        logits = hf(input_ids=mb["ids"][row, valid][None]).logits[0]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, mb["targets"][row, valid].unsqueeze(-1))
        total = total - logp.sum()
    return total / mb["valid"].sum()


def run_layout(cfg, family: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_shard, unfuse_hf_experts
    from megatron_dapo.weights.model_io import load_full_tensors, local_param_table, shard_group

    t0 = time.time()
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    hf = make_tiny_hf_model(family, seed=HF_SEED, attn_implementation="eager")
    # The plain per-expert loop (transformers' default grouped_mm takes no float64).
    hf.config._experts_implementation = "eager"
    hf64 = copy.deepcopy(hf).double()
    arch = model_arch_from_hf(hf.config.to_dict())
    padded = padded_vocab_size(
        arch.vocab_size, cfg.model.make_vocab_size_divisible_by, ps.get_tensor_model_parallel_world_size()
    )
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})

    # ---- references: fp32 logits of this rank's micro-batches; float64 grads of mean_DP(mean_mb(NLL)).
    hf_logits = {}
    with torch.no_grad():
        for mb in make_micro_batches(dp_rank):
            out = hf(input_ids=mb["ids"], attention_mask=mb["hf_mask"], position_ids=mb["pos"]).logits
            hf_logits[mb["index"]] = out
    total = 0.0
    for d in range(dp_size):
        mbs = make_micro_batches(d)
        for mb in mbs:
            total = total + unpadded_loss(hf64, mb) / (len(mbs) * dp_size)
    total.backward()
    hf_grads = unfuse_hf_experts({n: p.grad.detach() for n, p in hf64.named_parameters()})

    # ---- Megatron
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()
    captured, _ = run_schedule(model, make_micro_batches(dp_rank), VOCAB, SEQ, BATCH, token_loss)
    finalize_model_grads(model)

    result: dict[str, Any] = {"grads": [], "logits": {}, "experts": {}}
    for lp in local_param_table(model, arch):
        size, rank = shard_group(lp.mapping)
        ref_full = hf_to_mcore(lp.mapping, [hf_grads[n] for n in lp.mapping.hf], arch, padded)
        ref = tp_shard(ref_full, lp.mapping.kind, lp.mapping.tp_dim, size, rank)
        got = lp.param.main_grad
        err = (got.double() - ref).abs().max() / ref_full.abs().max().clamp(min=1e-30)
        result["grads"].append(
            {
                "mcore": lp.mapping.mcore,
                "local": lp.local_name,
                "expert": lp.mapping.expert,
                "rel_err": err.item(),
                # as tests/distributed does: ||got - ref|| / ||ref|| (Frobenius, over this rank's shard)
                "rel_err_norm": ((got.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item(),
                "ref_absmax": ref_full.abs().max().item(),
            }
        )
        if lp.mapping.expert is not None and lp.mapping.mcore.endswith("linear_fc2.weight"):
            result["experts"].setdefault(str(lp.mapping.layer), []).append(lp.mapping.expert)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for mb in mbs:
            i = mb["index"]
            diff = (captured[i] - hf_logits[i])[mb["valid"]].abs().max().item()
            result["logits"][str(i)] = {"max_abs": diff, "shape": list(captured[i].shape)}
    result["seconds"] = round(time.time() - t0, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    report: dict[str, Any] = {"layouts": {}}
    info = None
    for name in args.layouts.split(","):
        lay = parse_layout(name)
        cfg = load_config(
            None,
            [
                f"parallel.tensor_model_parallel_size={lay['tp']}",
                f"parallel.pipeline_model_parallel_size={lay['pp']}",
                f"parallel.expert_model_parallel_size={lay['ep']}",
                f"parallel.sequence_parallel={str(lay['sp']).lower()}",
                "parallel.platform=cpu",
                "model.params_dtype=fp32",
                "actor.moe_aux_loss_coeff=0",  # HF's reference has no router loss (the tiny config's coef is 0.001)
            ]
            + ([f"parallel.expert_tensor_parallel_size={lay['etp']}"] if lay["etp"] else []),
        )
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        entry = {
            "rank": info.rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "expert_dp_size": ps.get_expert_data_parallel_world_size(),
            "families": {family: run_layout(cfg, family) for family in args.families.split(",")},
        }
        report["layouts"][name] = entry
        destroy_model_parallel()

    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
