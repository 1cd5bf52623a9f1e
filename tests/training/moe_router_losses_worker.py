"""torchrun worker: the MoE router losses of a tiny Qwen3-MoE actor through the real actor (loss hook, DAPO
normalisers, ``MoEMeter`` weights), DP = world size.

For each micro-batch size in ``--micros`` it runs ``compute_gradients`` + ``MoEMeter.metrics`` on the shared batch
(``tests/distributed/loss_batch.make_batch``) with the router losses ``both`` on (``--aux``, ``--z``), ``z`` only,
``none``, and ``z_plain`` (z only, with megatron-core's plain mean over micro-batches and ranks instead of the token
weights: the control the split-invariance test must tell apart). ``--tp 2`` runs TP 2 with sequence parallelism
(experts split over TP too: ETP = TP). Rank 0 writes ``<out>/result.pt``: per run the DP-reduced, TP-merged
gradients by Megatron name (float64, vocabulary rows as padded for TP 1) and the metrics.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_dapo.actor import moe as moe_module
from megatron_dapo.actor.actor import MegatronActor, reduce_update_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_merge, unfuse_hf_experts
from megatron_dapo.weights.model_io import load_full_tensors, local_param_table
from tests.distributed.loss_batch import TEMPERATURE, make_batch
from tests.helpers.worker import each_layout


def plain_weights(micro_batches, config, device):
    """megatron-core's own weighting (coefficient factor 1): a plain mean over micro-batches and DP ranks."""
    from megatron.core import parallel_state as ps

    share = 1.0 / (len(micro_batches) * ps.get_data_parallel_world_size())
    tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1  # the z metric sums SP ranks
    return [{"aux": 1.0, "z": 1.0, "aux_frac": share, "z_frac": share / tp} for _ in micro_batches]


def run_layout(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--micros", default="8,3")
    ap.add_argument("--aux", type=float, required=True)
    ap.add_argument("--z", type=float, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--recompute", default="none")
    args = ap.parse_args(argv)
    tp_overrides = (
        [
            f"parallel.tensor_model_parallel_size={args.tp}",
            "parallel.sequence_parallel=true",
        ]
        if args.tp > 1
        else []
    )
    cfg = load_config(
        None,
        tp_overrides
        + [
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            f"parallel.pipeline_model_parallel_size={args.pp}",
            f"actor.recompute={args.recompute}",
            f"actor.moe_aux_loss_coeff={args.aux}",
            f"actor.moe_z_loss_coeff={args.z}",
        ],
    )
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen3_moe", seed=0)
    arch = model_arch_from_hf(hf.config.to_dict())
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
    padded_tp1 = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), chunks)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer)
    meter = actor.moe
    config = actor.model_config
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff == args.aux
    batch = TrainBatch(**make_batch())

    out: dict = {"runs": {}}
    for micro in [int(m) for m in args.micros.split(",")]:
        actor.cfg.ppo_micro_batch_size_per_gpu = micro
        for run, (aux, z) in {
            "both": (args.aux, args.z),
            "z": (0.0, args.z),
            "none": (0.0, 0.0),
            "z_plain": (0.0, args.z),
        }.items():
            meter.base_aux, meter.base_z = aux, z
            original = moe_module.router_loss_weights
            if run == "z_plain":
                moe_module.router_loss_weights = plain_weights
            try:
                results = actor.compute_gradients(batch, TEMPERATURE).micro_batch_sums
                metrics = meter.metrics(actor.device)
            finally:
                moe_module.router_loss_weights = original
            metrics.update(reduce_update_metrics(results, actor.cfg, actor.device))
            # the base coefficients are back after the update
            assert config.moe_aux_loss_coeff == aux and config.moe_z_loss_coeff == (z if z > 0 else None)
            grads = {}
            for lp in local_param_table(chunks, arch):
                g = lp.param.main_grad.detach().double().clone()
                if args.tp > 1 and lp.mapping.tp_dim is not None:  # EP 1: the expert TP group is the TP group
                    shards = [torch.empty_like(g) for _ in range(args.tp)]
                    dist.all_gather(shards, g.contiguous(), group=ps.get_tensor_model_parallel_group())
                    g = tp_merge(shards, lp.mapping.kind, lp.mapping.tp_dim)
                if lp.mapping.mcore.startswith(("embedding", "output_layer")):
                    assert torch.count_nonzero(g[padded_tp1:]) == 0
                    g = g[:padded_tp1]
                grads[lp.mapping.mcore] = g
            if args.pp > 1:  # every stage's gradients on rank 0 (stage 0)
                stages: list = [None] * args.pp
                dist.all_gather_object(stages, grads, group=ps.get_pipeline_model_parallel_group())
                grads = {k: v for stage in stages for k, v in stage.items()}
            out["runs"][f"{run}/mb{micro}"] = {"grads": grads, "metrics": metrics}
    out["world"] = dist.get_world_size()
    if info.rank == 0:  # DP-reduced and TP-merged: rank 0 holds everything
        os.makedirs(args.out, exist_ok=True)
        torch.save(out, os.path.join(args.out, "result.pt"))
        print("WORKER_OK")
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    """``RUNS.json``: a list of layouts (each the argument list above), run in sequence in one launch, each from a
    fresh default group with a torchrun attempt number of its own (the store prefix, ``parallel.attempt_store``)."""
    for argv in each_layout(sys.argv[1]):
        run_layout(argv)


if __name__ == "__main__":
    main()
