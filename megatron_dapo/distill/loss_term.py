"""On-policy distillation as the actor's extra loss term (``actor/extra_loss.ExtraLossTerm``): each micro-batch's
distillation loss (``objective.distillation_loss``, with the step's global normalisers) joined to the task's policy
loss by ``objective.combine_with_task_loss``, its metrics under verl's ``distillation/*`` names, reduced as
``objective.METRIC_REDUCTIONS`` says. No process group: the actor reduces the metrics over micro-batches and ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dapo.actor.extra_loss import EXTRA_LOSS
from megatron_dapo.algo.loss import LossNormalisers
from megatron_dapo.batch import MicroBatch
from megatron_dapo.distill.losses import DistillationInputs
from megatron_dapo.distill.objective import METRIC_REDUCTIONS, Normalisers, combine_with_task_loss, distillation_loss

__all__ = ["DistillationLossTerm"]


class DistillationLossTerm:
    """``distillation.distillation_loss`` (``loss``: that section) aggregated with ``loss_agg_mode`` (the actor's).

    The student's log-probs are the loss hook's (at the rollout temperature, as the policy loss reads them); the
    teacher's are ``mb.teacher_log_probs`` (``distill/teacher.py``). The loss covers the micro-batch's loss tokens
    (``mb.loss_mask``: sampled tokens of kept rows). On the policy-gradient path the old policy is
    ``mb.old_log_probs``, or on the on-policy path (none computed) this forward's own log-probs, detached.
    """

    def __init__(self, loss: Any, loss_agg_mode: str) -> None:
        self.cfg = loss
        self.loss_agg_mode = loss_agg_mode
        self.metric_reductions = {name: METRIC_REDUCTIONS.get(name, "mean") for name in self._metric_names()}

    def _metric_names(self) -> list[str]:
        """The names :func:`distillation_loss` reports for this section (one tiny call: the set depends only on
        the loss mode and the path)."""
        one = torch.zeros((1, 1))
        inputs = DistillationInputs(one + 1, self.cfg, student_log_probs=one, teacher_log_probs=one)
        _, metrics = distillation_loss(inputs, self.loss_agg_mode, Normalisers(), old_log_probs=one)
        return list(metrics)

    def combine(
        self, task_loss: torch.Tensor, log_probs: torch.Tensor, mb: MicroBatch, norm: LossNormalisers
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if mb.teacher_log_probs is None:
            raise ValueError("distillation: the micro-batch has no teacher_log_probs (the teacher stage did not run)")
        mask = mb.loss_mask.to(log_probs.dtype)
        inputs = DistillationInputs(
            mask, self.cfg, student_log_probs=log_probs, teacher_log_probs=mb.teacher_log_probs.to(log_probs.dtype)
        )
        old = mb.old_log_probs if mb.old_log_probs is not None else log_probs.detach()
        loss, metrics = distillation_loss(
            inputs,
            self.loss_agg_mode,
            Normalisers(norm.token_count, norm.seq_count, norm.max_response_length),
            old_log_probs=old,
            is_weights=mb.rollout_is_weights,
        )
        if not bool(mb.loss_mask.any()):  # no token to describe: its 0s would pull the extremes and means over the step
            metrics = {"distillation/loss": metrics["distillation/loss"]}
        metrics[EXTRA_LOSS] = loss.detach()
        return combine_with_task_loss(task_loss, loss, self.cfg), metrics
