"""torchrun worker: one DAPO update of a tiny Qwen3-MoE actor with expert parallelism (EP = world size), through the
real actor (loss hook, guarded step) and ``MoEMeter``. Writes ``<out>/rank<r>.pt``: metrics, the expert-load counts,
and whether the parameters moved."""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.optimizer import build_optimizer
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import init_distributed, init_model_parallel
from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
from megatron_dapo.weights.loading import load_mcore_checkpoint
from tests.distributed.loss_batch import TEMPERATURE, make_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(
        None,
        [
            f"parallel.expert_model_parallel_size={world}",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.optim.lr=1e-3",
        ],
    )
    info, _ = init_distributed(cfg.parallel)
    hf_dir = os.path.join(args.out, "hf")
    if info.rank == 0:
        save_tiny_hf_checkpoint(hf_dir, "qwen3_moe", seed=0)
    dist.barrier()
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(hf_dir)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_mcore_checkpoint(chunks, arch, hf_dir)
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=10)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)
    before = [p.detach().clone() for p in chunks[0].parameters()]
    metrics = actor.update(TrainBatch(**make_batch()), TEMPERATURE).metrics
    moved = [bool((p.detach() != b).any()) for p, b in zip(chunks[0].parameters(), before)]
    torch.save(
        {
            "metrics": metrics,
            "counts": actor.moe.last_counts,
            "moved": sum(moved) / len(moved),
            "topk": arch.moe_router_topk,
            "moe_layers": [i for i in range(arch.num_layers) if arch.is_moe_layer(i)],
        },
        os.path.join(args.out, f"rank{info.rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
