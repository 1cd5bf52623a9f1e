"""torchrun worker: MoE routing replay (``actor.router_replay=rollout``) on a tiny Qwen3.5-MoE (Gated DeltaNet and
gated full attention, every layer MoE: 4 experts, top-2, a gated shared expert; ``tests/models/qwen35_worker.py``)
through the real ``MegatronActor`` with recompute ``full``, against float64 HF transformers with the routing forced
by hand (``router_replay_worker.ForcedGates`` on the VLM's language model).

1. ``own``: the actor's recorded routing replayed: bit-identical log-probs, and it is HF's own routing;
2. ``forced``: a random routing replayed: HF's log-probs of that routing, far from the model's own;
3. ``update``: a routing that never picks expert ``UNUSED_EXPERT`` replayed in ``compute_gradients`` (the routers
   re-run in the backward pass): that expert gets no gradient in any layer; the same batch without replay (the
   routers' own choice) gives it one. Then ``actor.update`` applies the step.

Writes ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import copy
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_dapo.batch import TrainBatch
from megatron_dapo.rollout.routing import moe_layer_indices
from tests.distributed.loss_batch import TEMPERATURE, make_batch
from tests.models.qwen35_worker import tiny_hybrid_model
from tests.training.router_replay_worker import (
    ForcedGates,
    batch_log_probs,
    expert_grad_norms,
    random_routing,
    recorded_fields,
    row_routings_from_fields,
    with_routing,
)

UNUSED_EXPERT = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, unfuse_hf_experts
    from megatron_dapo.weights.model_io import load_full_tensors

    cfg = load_config(
        None,
        [
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "actor.moe_aux_loss_coeff=0",
            "actor.router_replay=rollout",
            "actor.recompute=full",
            "actor.use_remove_padding=false",  # the hybrids run unpacked (docs/qwen35.md)
            "actor.log_prob_micro_batch_size_per_gpu=8",  # one micro-batch: recorded_fields reads one forward
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.optim.lr=1e-3",
        ],
    )
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    hf = tiny_hybrid_model("qwen3_5_moe")
    arch = model_arch_from_hf(hf.config.to_dict())
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=10)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)
    result: dict = {"rank": info.rank, "replayer": actor.router_replay is not None}

    moe_layers = moe_layer_indices(arch)
    hf64 = copy.deepcopy(hf).double()
    # ForcedGates patches ``<model>.model.layers[i].mlp.gate``: the VLM keeps its decoder under language_model.
    gates = ForcedGates(SimpleNamespace(model=hf64.model.language_model), moe_layers)
    b = TrainBatch(**make_batch())
    mask = b.response_mask.bool()

    # 1. own routing: recorded, replayed.
    hf_own, hf_routing = batch_log_probs(gates, hf64, b)
    actor.router_replay.record()
    plain = actor.compute_log_probs(b, TEMPERATURE)["log_probs"]
    own = recorded_fields(actor, b)
    actor.router_replay.clear()
    replayed = actor.compute_log_probs(own, TEMPERATURE)["log_probs"]
    result["moe_layers"] = len(moe_layers)
    result["own_max_abs"] = (replayed - plain)[mask].abs().max().item()
    result["own_vs_hf_routing_equal"] = all(
        bool((a.long().sort(-1).values == h.long().sort(-1).values).all())
        for a, h in zip(row_routings_from_fields(own), hf_routing)
    )
    result["plain_vs_hf"] = (plain.double() - hf_own)[mask].abs().max().item()

    # 2. a forced random routing.
    forced_rows = random_routing(b, len(moe_layers), arch.num_experts, arch.moe_router_topk, seed=7)
    forced = actor.compute_log_probs(with_routing(b, forced_rows), TEMPERATURE)["log_probs"]
    hf_forced, _ = batch_log_probs(gates, hf64, b, forced_rows)
    result["forced_vs_hf"] = (forced.double() - hf_forced)[mask].abs().max().item()
    result["forced_vs_plain"] = (forced - plain)[mask].abs().max().item()

    # 3. the update: free routing, then a replayed routing without UNUSED_EXPERT.
    local_experts = arch.num_experts // cfg.parallel.expert_model_parallel_size
    actor.router_replay.record()  # the routers choose by themselves
    actor.compute_gradients(b, TEMPERATURE)
    actor.router_replay.clear()
    result["free_grads"] = expert_grad_norms(chunks, local_experts)
    unused_rows = random_routing(
        b, len(moe_layers), arch.num_experts, arch.moe_router_topk, seed=5, exclude=UNUSED_EXPERT
    )
    update_batch = with_routing(b, unused_rows)
    actor.compute_gradients(update_batch, TEMPERATURE)
    result["replayed_grads"] = expert_grad_norms(chunks, local_experts)
    metrics = actor.update(update_batch, TEMPERATURE).metrics
    result["update_ok"] = metrics["actor/update_ok"]
    torch.save(result, os.path.join(args.out, f"rank{info.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
