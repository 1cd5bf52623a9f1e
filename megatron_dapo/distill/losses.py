"""Per-token distillation losses by name: verl 0.9.1's ``DISTILLATION_LOSS_REGISTRY``
(``verl/trainer/distillation/losses.py``) as pure functions.

A registered loss takes :class:`DistillationInputs` (one micro-batch, ``[B, T]`` response tokens) and returns
``Terms``: ``losses[B, T]`` (the per-token loss, before ``loss_max_clamp``, as verl's registered function returns
it) and per-token metric terms. Aggregation, the clamp and the policy-gradient use are in ``objective.py``.

* ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``: single-sample estimators of the reverse KL
  ``KL(student || teacher)`` on the sampled token (``algo/kl.py``'s ``kl_penalty`` with the teacher as reference).
* ``forward_kl_topk``: ``sum_i q_i (log q_i - log p_i)`` over the teacher's top-k ids, ``q`` the teacher's and ``p``
  the student's probabilities, both log-probs clamped below at ``log_prob_min_clamp``; negative values (the top-k
  masses do not sum to 1) are clamped to 0. Values and gradients w.r.t. the student logits are those of verl's
  Megatron path (``verl/trainer/distillation/megatron/losses.py``): the masses are taken after the clamp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dapo.algo.kl import kl_penalty
from megatron_dapo.algo.registry import Registry

ESTIMATOR_MODES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES: tuple[str, ...] = ("forward_kl_topk",)

Terms = dict[str, torch.Tensor]

__all__ = [
    "DISTILLATION_LOSSES",
    "ESTIMATOR_MODES",
    "TOPK_MODES",
    "DistillationInputs",
    "LossSettings",
    "forward_kl_topk_terms",
    "get_distillation_loss",
    "loss_settings",
    "register_distillation_loss",
    "unknown_loss_mode",
]


@dataclass(frozen=True)
class LossSettings:
    """What a loss reads (verl's ``DistillationLossSettings``): the teacher's log-prob of each sampled token
    (``use_estimator``) or its top-k log-probs and ids with the student's logits (``use_topk``)."""

    use_topk: bool = False
    use_estimator: bool = False

    def __post_init__(self) -> None:
        if self.use_topk == self.use_estimator:
            raise ValueError(f"LossSettings: exactly one of use_topk, use_estimator must be true, got {self}")


@dataclass(frozen=True)
class DistillationInputs:
    """One micro-batch's distillation inputs, ``[B, T]`` over response tokens.

    ``student_log_probs``: the student's log-probs of the sampled tokens; ``teacher_log_probs``: the teacher's
    (estimator losses). ``student_logits[B, T, V]`` (the whole vocabulary), ``teacher_topk_log_probs[B, T, K]`` and
    ``teacher_topk_ids[B, T, K]`` (top-k losses). ``cfg``: the ``distillation.distillation_loss`` section.
    """

    response_mask: torch.Tensor
    cfg: Any  # config.schema.DistillationLossConfig (the package sits below config's rules, so duck-typed)
    student_log_probs: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None
    student_logits: Optional[torch.Tensor] = None
    teacher_topk_log_probs: Optional[torch.Tensor] = None
    teacher_topk_ids: Optional[torch.Tensor] = None


#: ``fn(inputs: DistillationInputs) -> Terms`` with ``losses[B, T]``; pure.
DISTILLATION_LOSSES: Registry = Registry("distillation loss", "distillation.distillation_loss.loss_mode")
_SETTINGS: dict[str, LossSettings] = {}


def register_distillation_loss(names: Sequence[str], settings: LossSettings) -> Callable[[Callable], Callable]:
    """Decorator registering a loss under each of ``names`` (aliases), with what it reads."""

    def add(fn: Callable) -> Callable:
        for name in names:
            DISTILLATION_LOSSES.register(name)(fn)
            _SETTINGS[name] = settings
        return fn

    return add


def unknown_loss_mode(name: str) -> str:
    """The problem text for an unregistered loss mode (config rules and :func:`get_distillation_loss`)."""
    return (
        f"{DISTILLATION_LOSSES.config_key}={name!r}: no such {DISTILLATION_LOSSES.kind}; registered:"
        f" {', '.join(DISTILLATION_LOSSES.names())}. Register your own with"
        " megatron_dapo.distill.losses.register_distillation_loss in a file named by algorithm.user_algorithms_file"
    )


def get_distillation_loss(name: str) -> Callable[[DistillationInputs], Terms]:
    """The loss registered as ``name``; an unknown name raises ``ValueError`` listing the registered ones."""
    if name not in DISTILLATION_LOSSES:
        raise ValueError(unknown_loss_mode(name))
    return DISTILLATION_LOSSES.get(name)


def loss_settings(name: str) -> LossSettings:
    """What the loss registered as ``name`` reads."""
    get_distillation_loss(name)
    return _SETTINGS[name]


def _need(inputs: DistillationInputs, field: str, ndim: int) -> torch.Tensor:
    """``inputs.<field>``, present and of the response mask's ``[B, T]`` shape (plus ``ndim - 2`` trailing dims)."""
    value = getattr(inputs, field)
    mask_shape = tuple(inputs.response_mask.shape)
    if value is None:
        raise ValueError(f"distillation loss {inputs.cfg.loss_mode!r} needs {field}, got None")
    if value.ndim != ndim or tuple(value.shape[:2]) != mask_shape:
        raise ValueError(
            f"{field}: expected a {ndim}-dim tensor whose first two dims are the response mask's {mask_shape}, got"
            f" {tuple(value.shape)}"
        )
    return value


@register_distillation_loss(ESTIMATOR_MODES, LossSettings(use_estimator=True))
def reverse_kl_estimator(inputs: DistillationInputs) -> Terms:
    """verl's ``compute_distillation_loss_reverse_kl_estimator``: ``kl_penalty(student, teacher, loss_mode)``
    per sampled token; metric term ``abs_loss`` (k1 can be negative, so verl logs its magnitude)."""
    student = _need(inputs, "student_log_probs", 2)
    teacher = _need(inputs, "teacher_log_probs", 2)
    losses = kl_penalty(student, teacher, inputs.cfg.loss_mode)
    return {"losses": losses, "abs_loss": losses.detach().abs()}


def _overlap_advantage(
    teacher_ids: torch.Tensor, student_ids: torch.Tensor, token_kl: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many teacher top-k ids are among the student's top-k, and the mean ``-q_i (log q_i - log p_i)`` over
    them (0 where none is): verl's overlap diagnostics (arXiv:2604.13016)."""
    overlap = (teacher_ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(dim=-1)
    count = overlap.sum(dim=-1)
    mean = (-token_kl * overlap).sum(dim=-1) / count.clamp_min(1)
    return count, torch.where(count > 0, mean, torch.zeros_like(mean))


def forward_kl_topk_terms(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    log_prob_min_clamp: Optional[float],
) -> Terms:
    """Forward KL over the teacher's top-k ids, per token (``[B, T, V]``, ``[B, T, K]`` x 2 -> ``[B, T]``).

    ``kl = sum_i q_i (t_i - s_i)`` with ``t``/``s`` the teacher's/student's top-k log-probs clamped below at
    ``log_prob_min_clamp`` (float32) and ``q = exp(t)``; the gradient w.r.t. the logits is
    ``m_A p_j - q_j [j in A]``, ``A`` the unclamped ids (verl's Megatron backward). Also ``student_mass`` and
    ``teacher_mass`` (``sum exp`` of the clamped top-k log-probs), ``overlap_count`` and
    ``overlap_token_advantage`` (detached).
    """
    student_log_probs = torch.log_softmax(student_logits.float(), dim=-1)
    ids = teacher_topk_ids.long()
    student = student_log_probs.gather(-1, ids)
    teacher = teacher_topk_log_probs.float()
    if log_prob_min_clamp is not None:
        student = student.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    token_kl = teacher.exp() * (teacher - student)
    with torch.no_grad():
        student_ids = torch.topk(student_log_probs, k=ids.shape[-1], dim=-1).indices
        count, advantage = _overlap_advantage(ids, student_ids, token_kl)
    return {
        "kl": token_kl.sum(dim=-1),
        "student_mass": student.detach().exp().sum(dim=-1),
        "teacher_mass": teacher.exp().sum(dim=-1),
        "overlap_count": count,
        "overlap_token_advantage": advantage,
    }


@register_distillation_loss(TOPK_MODES, LossSettings(use_topk=True))
def forward_kl_topk(inputs: DistillationInputs) -> Terms:
    """verl's ``compute_forward_kl_topk`` (:func:`forward_kl_topk_terms`), the per-token loss clamped at 0."""
    logits = _need(inputs, "student_logits", 3)
    teacher = _need(inputs, "teacher_topk_log_probs", 3)
    ids = _need(inputs, "teacher_topk_ids", 3)
    if teacher.shape != ids.shape:
        raise ValueError(
            f"teacher_topk_log_probs {tuple(teacher.shape)} and teacher_topk_ids {tuple(ids.shape)} differ in shape"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= logits.shape[-1]):
        raise ValueError(
            f"teacher_topk_ids: expected ids in [0, {logits.shape[-1]}) (the student's vocabulary), got"
            f" [{int(ids.min())}, {int(ids.max())}]"
        )
    terms = forward_kl_topk_terms(logits, teacher, ids, inputs.cfg.log_prob_min_clamp)
    terms["losses"] = terms.pop("kl").clamp_min(0.0)
    return terms
