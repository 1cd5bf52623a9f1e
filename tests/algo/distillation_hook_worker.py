"""torchrun worker: the actor's loss hook with the distillation term (``distill/loss_term.DistillationLossTerm``) on the
fixed batch of ``tests/distributed/loss_batch.py`` plus fixed teacher log-probs, under the layouts given
(``--layout NAME ARGS``, as ``tests/distributed/loss_worker.py``), for each case of ``CASES``; then (``--teachers``)
two teachers scoring routed rows (``score_teachers``). One launch for both.

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
from megatron_dapo.config.plan import build_plan
from megatron_dapo.config.schema import DistillationLossConfig
from megatron_dapo.data.tokens import load_tokenizer
from megatron_dapo.distill.loss_term import DistillationLossTerm
from megatron_dapo.distill.teacher import DistillationTeachers
from megatron_dapo.handoff.offload import MemoryHandoff
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


KEYS = ["math", "code", "math", "math", "code", "math", "code", "math"]  # 5 x math, 3 x code


def make_routed_batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(11)
    rows, prompt_width, width = len(KEYS), 5, 6
    prompt_lens = [5, 2, 4, 1, 3, 5, 2, 4]
    response_lens = [6, 3, 1, 5, 6, 2, 4, 6]
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    responses = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, prompt_width - p :] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    return TrainBatch(prompts, prompt_mask, responses, response_mask, data_source=list(KEYS))


def score_teachers(root: str) -> None:
    """Two teachers of different architectures built by ``DistillationTeachers.build`` as the trainer builds them (one
    from its HF weights, one from its converted Megatron checkpoint) at DP 2 score a batch whose rows ``data_source``
    routes to them (an odd number of rows each: the forward's rows are filled up to the DP size). Writes
    ``<root>/scored.pt`` (rank 0)."""
    cfg = load_config(
        None,
        [
            f"model.hf_config_dir={root}/math",
            f"model.tokenizer_dir={root}/tokenizer",
            "distillation.enabled=true",
            "distillation.teacher_models.math_teacher.key=math",
            f"distillation.teacher_models.math_teacher.model_path={root}/math",  # its HF weights
            "distillation.teacher_models.code_teacher.key=code",
            f"distillation.teacher_models.code_teacher.model_path={root}/code",
            f"distillation.teacher_models.code_teacher.load_dir={root}/code_mcore",  # its converted checkpoint
            "actor.log_prob_micro_batch_size_per_gpu=2",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(f"{root}/math")
    plan = build_plan(cfg, arch, info.world_size, platform, probe_imports=False)
    handoff = MemoryHandoff(platform, plan.handoff, [])
    tokenizer = load_tokenizer(cfg.model.tokenizer_dir, cfg.model.hf_config_dir)
    teachers = DistillationTeachers.build(
        cfg.distillation, cfg.model, cfg.parallel, cfg.actor, plan, tokenizer, handoff
    )
    batch = make_routed_batch(len(tokenizer))
    metrics = teachers.score(batch)
    if info.rank == 0:
        torch.save({"batch": batch, "teacher_log_probs": batch.teacher_log_probs, "metrics": metrics},
                   os.path.join(root, "scored.pt"))  # fmt: skip
        print("WORKER_OK")
    dist.barrier()
    destroy_model_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", nargs=2, action="append", metavar=("NAME", "ARGS"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--teachers", help="a directory of two teachers and their tokenizer (score_teachers)")
    args = ap.parse_args()
    for name, layout in args.layout:
        run_layout(layout_args(shlex.split(layout)), os.path.join(args.out, name))
    if args.teachers:
        score_teachers(args.teachers)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
