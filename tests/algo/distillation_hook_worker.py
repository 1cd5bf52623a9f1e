"""torchrun worker: the actor's loss hook with the distillation term (``distill/loss_term.DistillationLossTerm``) on the
fixed batch of ``tests/distributed/loss_batch.py`` plus fixed teacher log-probs, under the layouts given
(``--layout NAME ARGS``, as ``tests/distributed/loss_worker.py``), for each case of ``CASES``.

Writes ``<out>/<NAME>/result.pt`` (rank 0): per case, the TP-merged gradients by global Megatron name and the
update's metrics (``actor/*`` and ``distillation/*``, reduced over micro-batches and ranks).
"""

import argparse
import os
import shlex

import torch
import torch.distributed as dist

from megatron_dapo.actor.actor import MegatronActor, reduce_update_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.config.schema import DistillationLossConfig
from megatron_dapo.distill.loss_term import DistillationLossTerm
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_merge
from megatron_dapo.weights.model_io import load_full_tensors, local_param_table
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch
from tests.distributed.loss_worker import layout_args

# name: (the distillation loss section, actor.loss_agg_mode)
CASES = {
    "k3_alone": (DistillationLossConfig(loss_mode="k3", use_task_rewards=False), "seq-mean-token-mean"),
    "k1_pg_with_task": (
        DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, distillation_loss_coef=0.5),
        "token-mean",
    ),
}


def teacher_log_probs(batch: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (-4.4 + 0.8 * torch.randn(batch["responses"].shape, generator=g)) * batch["response_mask"].float()


def full_grads(chunks, arch, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    local = {}
    for entry in local_param_table([c.module for c in chunks], arch):
        g = entry.param.main_grad.detach().float()
        if entry.mapping.tp_dim is not None and tp > 1:
            shards = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(shards, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = tp_merge(shards, entry.mapping.kind, entry.mapping.tp_dim)
        local[entry.mapping.mcore] = g
    return local


def run_layout(args: argparse.Namespace, out_dir: str) -> None:
    overrides = [
        f"parallel.tensor_model_parallel_size={args.tp}",
        f"actor.ppo_micro_batch_size_per_gpu={args.micro}",
        "actor.clip_ratio_c=10.0",
    ]
    cfg = load_config(None, overrides)
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS)
    arch = model_arch_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [sd[n] for n in m.hf], arch, pv))
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), chunks)
    raw = make_batch()
    batch = TrainBatch(**raw, teacher_log_probs=teacher_log_probs(raw))
    out = {}
    for name, (loss_cfg, agg) in CASES.items():
        cfg.actor.loss_agg_mode = agg
        term = DistillationLossTerm(loss_cfg, agg)
        actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer, extra_loss=term)
        grads = actor.compute_gradients(batch, TEMPERATURE)
        metrics = reduce_update_metrics(grads.micro_batch_sums, actor.cfg, actor.device)
        metrics.update(actor._extra_metrics(grads.micro_batch_sums))
        gathered = [None] * dist.get_world_size()
        from megatron.core import parallel_state as ps

        mine = full_grads(chunks, arch, args.tp)
        dist.all_gather_object(gathered, mine if ps.get_data_parallel_rank() == 0 else {})
        out[name] = {"grads": gathered[0], "metrics": metrics}
    if info.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(out, os.path.join(out_dir, "result.pt"))
        print("WORKER_OK")
    dist.barrier()
    destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", nargs=2, action="append", metavar=("NAME", "ARGS"), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for name, layout in args.layout:
        run_layout(layout_args(shlex.split(layout)), os.path.join(args.out, name))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
