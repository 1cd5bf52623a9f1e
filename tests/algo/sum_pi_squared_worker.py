"""Worker for the tensor-parallel ``response_sum_pi_squared`` test: 2 ranks, each holding half of the padded
vocabulary (rank 1's half ends in padding). Writes each rank's result and the float64 reference on the whole true
vocabulary to ``<out>/rank<r>.pt``."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_dapo.algo.logprobs import response_sum_pi_squared

B, S, V_PADDED, TRUE_VOCAB, T = 2, 12, 40, 37, 9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, S, V_PADDED, generator=gen) * 4
    index = torch.randint(0, S, (B, T), generator=gen)
    shard = V_PADDED // 2
    mine = logits[..., rank * shard : (rank + 1) * shard].contiguous()
    got = response_sum_pi_squared(
        mine, index, TRUE_VOCAB, 0.7, vocab_start=rank * shard, tp_group=dist.group.WORLD, chunk_tokens=4
    )
    rows = logits.double()[torch.arange(B).unsqueeze(-1), index][..., :TRUE_VOCAB] / 0.7
    reference = torch.softmax(rows, -1).pow(2).sum(-1)
    torch.save({"got": got, "reference": reference}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
