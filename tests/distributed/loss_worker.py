"""torchrun worker: DAPO loss gradients of a fixed batch through megatron-core under parallel layouts of one world
size, one after the other in the same processes (``--layout NAME ARGS``, repeated; ARGS as one string).

Writes ``<out>/<NAME>/result.pt`` (rank 0): full (TP-merged, all PP stages) gradients by global Megatron name, the
loss metrics, and the forward-only log-probs. The test compares layouts with each other and with a float64 HF
reference computed independently.
"""

import argparse
import os
import shlex
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_dapo.actor.actor import MegatronActor, reduce_update_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_merge
from megatron_dapo.weights.model_io import load_full_tensors, local_param_table
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch


def layout_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--dynamic-tokens", type=int, default=None)
    ap.add_argument("--overlap-bucket", type=int, default=None, help="parallel.overlap_grad_reduce with this bucket")
    return ap.parse_args(argv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", nargs=2, action="append", metavar=("NAME", "ARGS"), required=True)
    ap.add_argument("--modes", default="token-mean")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for name, layout in args.layout:
        run_layout(layout_args(shlex.split(layout)), args.modes.split(","), os.path.join(args.out, name))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(args: argparse.Namespace, modes: list[str], out_dir: str) -> None:
    overrides = [
        f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.pipeline_model_parallel_size={args.pp}",
        f"parallel.sequence_parallel={'true' if args.sp else 'false'}",
        f"actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor.log_prob_micro_batch_size_per_gpu={args.micro}",
        "actor.entropy_coeff=0.01",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.1",
    ]
    if args.vpp:
        overrides.append(f"parallel.virtual_pipeline_model_parallel_size={args.vpp}")
    if args.dynamic_tokens:
        overrides += ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={args.dynamic_tokens}"]
    if args.overlap_bucket:
        overrides += ["parallel.overlap_grad_reduce=true", f"parallel.ddp_bucket_size={args.overlap_bucket}"]
    cfg = load_config(None, overrides)
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS)
    arch = model_arch_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [sd[n] for n in m.hf], arch, pv))
    chunks = wrap_for_training(chunks, cfg.parallel)
    buckets = sum(len(group.buckets) for c in chunks for group in c.bucket_groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), chunks)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer)

    batch = TrainBatch(**make_batch())
    lp = actor.compute_log_probs(batch, TEMPERATURE, calculate_entropy=True)
    out = {"log_probs": lp["log_probs"], "entropy": lp["entropy"], "grad_buckets": buckets}
    # The on-policy update (no old-policy forward) against the recomputed path: the old log-probs are the policy's
    # own (lp), the rollout's are perturbed so that the mismatch metric and the IS weights have something to show.
    noise = 0.05 * torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(7))
    rollout_lp = (lp["log_probs"] + noise) * batch.response_mask
    paths = {
        "recomputed": replace(batch, old_log_probs=lp["log_probs"], rollout_log_probs=rollout_lp),
        "on_policy": replace(batch, old_log_probs=None, rollout_log_probs=rollout_lp),
    }
    runs = [(mode, batch) for mode in modes] + [(f"path:{k}", v) for k, v in paths.items()]
    out["rollout_log_probs"] = rollout_lp
    for mode, mini_batch in runs:
        actor.cfg.loss_agg_mode = mode if not mode.startswith("path:") else "token-mean"
        threshold = 1.02 if mode.startswith("path:") else None
        if mode == "path:recomputed":  # the trainer computes the IS weights before the update on this path
            from megatron_dapo.algo.loss_aggregation import compute_rollout_is_weights

            mini_batch = replace(
                mini_batch,
                rollout_is_weights=compute_rollout_is_weights(
                    lp["log_probs"], rollout_lp, batch.response_mask, threshold
                ),
            )
        grads = actor.compute_gradients(mini_batch, TEMPERATURE, threshold)
        results, padding = grads.micro_batch_sums, grads.padding_ratio
        metrics = reduce_update_metrics(results, actor.cfg, actor.device)
        metrics["perf/padding_ratio/update"] = padding
        # Full gradients: TP-merge per tensor, then collect every PP stage's tensors on rank 0.
        local = {}
        for entry in local_param_table([c.module for c in chunks], arch):
            g = entry.param.main_grad.detach().float()
            if entry.mapping.tp_dim is not None and args.tp > 1:
                shards = [torch.empty_like(g) for _ in range(args.tp)]
                dist.all_gather(shards, g.contiguous(), group=ps.get_tensor_model_parallel_group())
                g = tp_merge(shards, entry.mapping.kind, entry.mapping.tp_dim)
            local[entry.mapping.mcore] = g
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(
            gathered, local if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0 else {}
        )
        if info.rank == 0:
            grads = {}
            for part in gathered:
                for k, v in part.items():
                    # Tied embeddings: finalize_model_grads already summed the first/last-stage copies.
                    grads.setdefault(k, v)
            out[mode] = {"grads": grads, "metrics": metrics}
    if info.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(out, os.path.join(out_dir, "result.pt"))
        print("WORKER_OK")
    dist.barrier()
    destroy_model_parallel()


if __name__ == "__main__":
    main()
