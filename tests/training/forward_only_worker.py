"""Two processes: a log-prob pass builds no autograd graph, and its live bytes do not grow with its micro-batches.

For each layout (pipeline parallel 2: megatron-core's 1F1B schedule; data parallel 2: the no-pipelining schedule),
``MegatronActor.compute_log_probs`` (with entropy and ``Σ π²``) runs under ``saved_tensors_hooks`` that count every
tensor autograd saves for a backward, and under the device ledger's ``AllocationMeter`` (every storage created,
charged until freed) on batches of 2 and 8 micro-batches per rank.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.batch import TrainBatch
from megatron_dapo.parallel import teardown
from megatron_dapo.testing.allocation_meter import AllocationMeter
from tests.distributed.loss_batch import TEMPERATURE, make_batch
from tests.training.common import build_actor, tiny_arch

LAYOUTS = {"pp2": ("parallel.pipeline_model_parallel_size=2",), "dp2": ()}


def batch_of(copies: int) -> TrainBatch:
    one = make_batch()
    return TrainBatch(**{k: torch.cat([v] * copies) for k, v in one.items()})


def measure(actor: MegatronActor, batch: TrainBatch) -> dict:
    """Saved tensors, and the pass's peak bytes above what was live before it (the results it returns excluded)."""
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    meter = AllocationMeter()
    with meter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = actor.compute_log_probs(batch, TEMPERATURE, calculate_entropy=True, calculate_sum_pi_squared=True)
    data = sum(t.numel() * t.element_size() for t in vars(batch).values() if isinstance(t, torch.Tensor))
    return {"saved": saved[0], "transient": meter.peak, "batch_bytes": data, "sum": float(out["log_probs"].sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report = {}
    for name, extra in LAYOUTS.items():
        cfg, chunks = build_actor("fp32", dist_opt=False, extra=(*extra, "actor.log_prob_micro_batch_size_per_gpu=2"))
        actor = MegatronActor(chunks, tiny_arch().vocab_size, cfg.actor)
        measure(actor, batch_of(1))  # warm-up: megatron-core's first-call buffers
        # 8 rows per rank in micro-batches of 2 (dp2: 16 rows), then 4x the rows: 4 and 16 micro-batches.
        dp = 2 if name == "dp2" else 1
        report[name] = {"few": measure(actor, batch_of(dp)), "many": measure(actor, batch_of(4 * dp))}
        report[name]["micro_batches"] = [len(make_batch()["prompts"]) * copies // 2 for copies in (1, 4)]
        del actor, chunks
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    teardown(None)  # a live gloo group at interpreter exit can abort the process


if __name__ == "__main__":
    main()
