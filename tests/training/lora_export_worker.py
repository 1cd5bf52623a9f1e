"""torchrun worker for ``tests/training/test_lora_export.py``: real LoRA training checkpoints, without vLLM and
without the trainer (2 processes, fp32), of the two models the test wrote under ``--root``: ``dense`` (qwen2, TP 2)
and ``moe`` (qwen2_moe: routed experts and a shared expert, TP 2 + SP, EP 2, expert TP 1).

For each, each rank: builds the chunks the trainer's way, loads the base (``<root>/<phase>/mcore``, the converter's
output), ``apply_lora`` with every adapter weight drawn at random (non-zero A and B, seeded by name and rank),
``wrap_for_training``, ``build_optimizer``, one optimizer step on random gradients, then
``CheckpointManager(<root>/<phase>/ckpt, states={"lora": LoraBase(load_dir, lora)}).save(1, ...)`` with the run's
config, and the logits of a fixed input (``fixed_ids``, gathered over TP, true vocabulary) into
``<root>/<phase>/logits.pt`` (rank 0). Imports stay inside functions: megatron-core's checkpoint writer spawns a
helper that re-imports this file.
"""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path

RANK, ALPHA = 4, 8.0
SEQ, BATCH, SEED = 12, 2, 1234


def fixed_ids(vocab: int):
    """The fixed input both the worker and the test run: ``[BATCH, SEQ]`` token ids."""
    import torch

    return torch.randint(1, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))


PHASES = {
    "dense": ["parallel.tensor_model_parallel_size=2"],
    "moe": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=2",
        "parallel.expert_tensor_parallel_size=1",
        "actor.moe_aux_loss_coeff=0",
    ],
}


def run_config(root: Path, phase: str):
    """The run's config (saved with the checkpoint): fp32, the base as ``checkpoint.load_dir``, LoRA rank 4."""
    from megatron_dapo.config import load_config

    tokenizer = [f"model.tokenizer_dir={root / 'tokenizer'}"] if phase == "dense" else []
    return load_config(
        None,
        [
            "model.params_dtype=fp32",
            "actor.optim.lr=0.01",
            "parallel.platform=cpu",
            f"checkpoint.load_dir={root / phase / 'mcore'}",
            f"actor.lora.rank={RANK}",
            f"actor.lora.alpha={ALPHA}",
            *tokenizer,
            *PHASES[phase],
        ],
    )


def randomise_adapters(chunks: list) -> int:
    """Every adapter shard drawn from N(0, 0.05²), seeded by its name and this rank (all of them are TP-sharded)."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.models.lora import adapter_named_parameters

    params = adapter_named_parameters(chunks)
    with torch.no_grad():
        for name, p in params:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * dist.get_rank())
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return len(params)


def optimizer_step(chunks: list, optimizer, scheduler) -> None:
    """One step on random gradients of the trainable (adapter) parameters."""
    import torch
    import torch.distributed as dist

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    g = torch.Generator().manual_seed(99 + dist.get_rank())
    for chunk in chunks:
        for p in chunk.parameters():
            if p.requires_grad:
                p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.01)
    for chunk in chunks:
        chunk.finish_grad_sync()
    optimizer.step()
    scheduler.step(1)


def logits(chunks: list, vocab: int):
    """Full logits of the fixed input (causal, no padding), over the true vocabulary."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids = fixed_ids(vocab)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        out = chunks[0](ids, pos, mask)
        return gather_from_tensor_model_parallel_region(out)[..., :vocab].clone()


def run_phase(root: Path, phase: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.checkpointing.checkpoint import CheckpointManager
    from megatron_dapo.config import to_dict
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.lora import apply_lora
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.training.run_state import LoraBase
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    cfg = run_config(root, phase)
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(root / phase / "hf")
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_mcore_checkpoint(chunks, arch, cfg.checkpoint.load_dir)
    apply_lora(chunks, cfg.actor.lora)
    randomise_adapters(chunks)
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer, scheduler = build_optimizer(chunks, cfg.actor.optim, 10)
    optimizer_step(chunks, optimizer, scheduler)
    lora_base = LoraBase(cfg.checkpoint.load_dir, cfg.actor.lora)
    manager = CheckpointManager(root / phase / "ckpt", states={"lora": lora_base})
    manager.save(1, chunks, optimizer, scheduler, config=to_dict(cfg))
    out = logits(chunks, arch.vocab_size)
    if dist.get_rank() == 0:
        torch.save(out, root / phase / "logits.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from megatron_dapo.parallel import destroy_model_parallel

    for phase in PHASES:
        run_phase(Path(args.root), phase)
        destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
