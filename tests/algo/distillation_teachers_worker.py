"""torchrun worker (2 processes, DP 2): two teachers of different architectures built by
``DistillationTeachers.build`` as the trainer builds them (one from its HF weights, one from its converted Megatron
checkpoint), scoring a batch whose rows are routed by ``data_source`` (an odd number of rows each: the forward's
rows are filled up to the DP size). Writes ``<out>/teacher_log_probs.pt`` (rank 0) and the batch it scored."""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.config.plan import build_plan
from megatron_dapo.data.tokens import load_tokenizer
from megatron_dapo.distill.teacher import DistillationTeachers
from megatron_dapo.handoff.offload import MemoryHandoff
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import init_distributed, init_model_parallel

KEYS = ["math", "code", "math", "math", "code", "math", "code", "math"]  # 5 x math, 3 x code


def make_batch(vocab: int) -> TrainBatch:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    root = args.root
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
    batch = make_batch(len(tokenizer))
    metrics = teachers.score(batch)
    if info.rank == 0:
        torch.save({"batch": batch, "teacher_log_probs": batch.teacher_log_probs, "metrics": metrics},
                   os.path.join(root, "scored.pt"))  # fmt: skip
        print("WORKER_OK")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
