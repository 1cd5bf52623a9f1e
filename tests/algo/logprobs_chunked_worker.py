"""Worker for the tensor-parallel ``response_log_probs`` test: 2 ranks, each holding half of the (padded) vocabulary.

Each rank computes the single-process result on the whole vocabulary itself, then the vocab-parallel result on its
shard over the 2-rank group, and writes the relative differences (log-probs, entropy, its shard of the gradient) to
``<out>/rank<r>.json``; the test asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.algo.logprobs import response_log_probs

B, S, V_PADDED, T = 2, 12, 40, 9

# name: (true vocabulary, chunk, temperature, entropy grad, with entropy, gradient into logits, dtype)
CASES = {
    "pad3_chunk1": (37, 1, 1.0, True, True, False, torch.float32),
    "pad3_chunk5": (37, 5, 0.7, True, True, False, torch.float32),
    "pad3_chunk64_no_entropy_grad": (37, 64, 0.7, False, True, False, torch.float32),
    "pad3_chunk5_into_logits": (37, 5, 0.7, True, True, True, torch.float32),
    "pad3_no_entropy": (37, 5, 0.7, False, False, False, torch.float32),
    "rank1_all_padding": (17, 5, 0.7, True, True, False, torch.float32),
    "rank1_all_padding_chunk64": (17, 64, 1.0, False, True, True, torch.float32),
    "bf16_pad3_chunk5": (37, 5, 0.7, True, True, False, torch.bfloat16),
}


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / scale.double().abs().max().clamp(min=1e-30)).item()


def run(logits, index, tokens, weights, true_vocab, chunk, temperature, ent_grad, with_ent, into, start, group):
    x = logits.clone().requires_grad_(True)
    y = x * 1
    logp, ent = response_log_probs(
        y, index, tokens, true_vocab, temperature, vocab_start=start, tp_group=group, chunk_tokens=chunk,
        with_entropy=with_ent, entropy_requires_grad=ent_grad, grad_into_logits=into,
    )  # fmt: skip
    objective = (logp * weights[0]).sum()
    if ent_grad:
        objective = objective + (ent * weights[1]).sum()
    objective.backward()
    return logp.detach(), (ent.detach() if ent is not None else torch.zeros(())), x.grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = V_PADDED // world
    results = {}
    for seed, (name, (true_vocab, chunk, temp, ent_grad, with_ent, into, dtype)) in enumerate(CASES.items()):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(B, S, V_PADDED, generator=g) * 3).to(dtype)
        index = torch.stack([torch.arange(2, 2 + T), (torch.arange(T) + 5).clamp(max=S - 1)])
        tokens = torch.randint(0, true_vocab, (B, T), generator=g)
        weights = torch.randn(2, B, T, generator=g)
        common = (index, tokens, weights, true_vocab, chunk, temp, ent_grad, with_ent, into)
        full = run(logits, *common, 0, None)
        shard = logits[..., rank * width : (rank + 1) * width].contiguous()
        mine = run(shard, *common, rank * width, dist.group.WORLD)
        full_grad_shard = full[2][..., rank * width : (rank + 1) * width]
        results[name] = {
            "log_probs": rel_err(mine[0], full[0], full[0]),
            "entropy": rel_err(mine[1], full[1], full[1]),
            "grad": rel_err(mine[2], full_grad_shard, full[2]),
        }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} pid {os.getpid()} done: {results}")


if __name__ == "__main__":
    main()
