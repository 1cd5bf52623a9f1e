"""``Σ π²`` per response position (``algo/logprobs.response_sum_pi_squared``), the optimal-token-baseline
estimators' input, against a float64 softmax: one process (padding columns excluded, temperature applied, rows shared
by several positions) and 2 tensor-parallel ranks over gloo (the vocabulary split, sums reduced over the group)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_dapo.algo.logprobs import response_sum_pi_squared
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("sum_pi_squared_worker.py")
TP_PORT = 29747  # algo area: 29740-29749


def test_single_process_matches_a_float64_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 10, 24, generator=gen) * 5
    index = torch.tensor([[0, 3, 3, 9], [1, 1, 2, 2], [9, 8, 7, 6]])  # positions shared by several tokens
    got = response_sum_pi_squared(logits, index, true_vocab_size=21, temperature=0.8, chunk_tokens=3)
    rows = logits.double()[torch.arange(3).unsqueeze(-1), index][..., :21] / 0.8
    reference = torch.softmax(rows, -1).pow(2).sum(-1)
    torch.testing.assert_close(got.double(), reference, rtol=1e-6, atol=0)
    assert got.shape == index.shape and float(got.min()) >= 1 / 21


def test_tensor_parallel_two_ranks_match_the_whole_vocabulary(tmp_path: Path):
    run_torchrun(WORKER, 2, ["--out", str(tmp_path)], port=TP_PORT, timeout=240)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(r["got"].double(), r["reference"], rtol=1e-6, atol=0)
