"""The seam for a loss term the actor adds to its policy loss in the loss hook (``MegatronActor(extra_loss=...)``).

A term sees each micro-batch's response log-probs (differentiable), the micro-batch, the step's global normalisers
and the task's policy loss, and returns the loss to back-propagate with its metrics. The actor knows no term by
name: ``distill/loss_term.DistillationLossTerm`` (on-policy distillation) is one. The metrics come back per
micro-batch; :func:`reduce_term_metrics` combines them over micro-batches, from the last pipeline stage and over the
data-parallel ranks, each as the term's ``metric_reductions`` says (``sum``, ``mean``, ``min``, ``max``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_dapo.algo.loss import LossNormalisers
from megatron_dapo.batch import MicroBatch

EXTRA_LOSS = "extra_loss"  # the key of the term's own loss in a micro-batch's sums (checked finite by the update)

__all__ = ["EXTRA_LOSS", "ExtraLossTerm", "reduce_term_metrics"]


class ExtraLossTerm(Protocol):
    """A loss term joined to the policy loss in the actor's loss hook."""

    #: every metric name the term reports, with how it combines: "sum", "mean", "min" or "max"
    metric_reductions: dict[str, str]

    def combine(
        self, task_loss: torch.Tensor, log_probs: torch.Tensor, mb: MicroBatch, norm: LossNormalisers
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss to back-propagate (the task's ``task_loss`` joined with the term's) and the term's
        metrics (detached 0-dim tensors; ``EXTRA_LOSS``: the term's own loss, for the finiteness check)."""
        ...


@torch.no_grad()
def reduce_term_metrics(
    results: list[dict], reductions: dict[str, str], device: torch.device, is_last_stage: bool, broadcast, group
) -> dict[str, float]:
    """The term's metrics of one mini-batch: each named metric over ``results`` (the loss hook's per-micro-batch
    dicts, on the last pipeline stage), broadcast to every stage (``broadcast(t)``, in place) and over ``group``
    (data-parallel ranks). ``mean``: the plain mean over micro-batches and ranks, as verl's metric lists."""
    names = sorted(reductions)
    # [sum, count, min, max] per metric; min/max start at +-inf so a rank without the metric does not change them
    stats = torch.zeros((len(names), 4), dtype=torch.float64, device=device)
    stats[:, 2], stats[:, 3] = float("inf"), float("-inf")
    if is_last_stage:
        for res in results:
            for i, name in enumerate(names):
                if name in res:
                    value = float(res[name])
                    stats[i, 0] += value
                    stats[i, 1] += 1
                    stats[i, 2] = min(float(stats[i, 2]), value)
                    stats[i, 3] = max(float(stats[i, 3]), value)
    broadcast(stats)
    sums, lows, highs = stats[:, :2].clone(), stats[:, 2].clone(), stats[:, 3].clone()
    dist.all_reduce(sums, group=group)
    dist.all_reduce(lows, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for i, name in enumerate(names):
        total, count = float(sums[i, 0]), float(sums[i, 1])
        if count == 0:
            continue
        kind = reductions[name]
        out[name] = {"sum": total, "mean": total / count, "min": float(lows[i]), "max": float(highs[i])}[kind]
    return out
