"""The ``distillation`` section's rules (verl 0.9.1 ``verl/workers/config/distillation.py``, its ``__post_init__``
checks as problem lines) and the teachers by routing key. ``config/rules.py`` calls
:func:`distillation_problems`; nothing here reads a file or a model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from megatron_dapo.algo.registry import POLICY_LOSSES
from megatron_dapo.distill.losses import DISTILLATION_LOSSES, loss_settings, unknown_loss_mode

if TYPE_CHECKING:  # the config package imports this module through its rules
    from megatron_dapo.config.schema import DistillationConfig, DistillationTeacherConfig

SECTION = "distillation"
SINGLE_TEACHER = "teacher_model"  # verl's default entry name; alone it scores every row
DEFAULT_KEY = "default"
PG_POLICY_LOSSES = ("vanilla",)  # verl 0.9.1 refuses any other policy loss on the distillation path

ROUTING_FIELDS = ("data_source",)  # the row fields a training batch carries (batch.TrainBatch) to route by

__all__ = ["distillation_problems", "distillation_run_problems", "teacher_for", "teachers_by_key"]


def _loss_problems(loss: Any) -> list[str]:
    key = f"{SECTION}.distillation_loss"
    if loss.loss_mode not in DISTILLATION_LOSSES:
        return [unknown_loss_mode(loss.loss_mode)]
    out = []
    if loss_settings(loss.loss_mode).use_topk and not (isinstance(loss.topk, int) and loss.topk >= 1):
        out.append(f"{key}.topk={loss.topk!r}: expected an integer >= 1 with loss_mode={loss.loss_mode!r}")
    if not loss.use_policy_gradient and loss.loss_mode in ("k1", "kl"):
        out.append(
            f"{key}.loss_mode={loss.loss_mode!r} with use_policy_gradient=false: expected use_policy_gradient=true"
            " or loss_mode k3/low_var_kl, k2/mse, abs or forward_kl_topk (k1's gradient does not depend on the"
            " teacher)"
        )
    if loss.use_policy_gradient and loss.policy_loss_mode not in PG_POLICY_LOSSES:
        known = loss.policy_loss_mode in POLICY_LOSSES
        out.append(
            f"{key}.policy_loss_mode={loss.policy_loss_mode!r}: expected one of {', '.join(PG_POLICY_LOSSES)}"
            + ("" if known else " (not a registered policy loss either)")
        )
    if not (math.isfinite(loss.distillation_loss_coef) and loss.distillation_loss_coef >= 0):
        out.append(f"{key}.distillation_loss_coef={loss.distillation_loss_coef!r}: expected a finite value >= 0")
    if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
        out.append(f"{key}.loss_max_clamp={loss.loss_max_clamp!r}: expected null or a value > 0")
    if loss.log_prob_min_clamp is not None and not loss.log_prob_min_clamp < 0:
        out.append(f"{key}.log_prob_min_clamp={loss.log_prob_min_clamp!r}: expected null or a log-prob < 0")
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(loss, name)
        if value is not None and not (0 <= value < 1 if name != "clip_ratio_high" else 0 <= value < math.inf):
            bound = "[0, 1)" if name != "clip_ratio_high" else "[0, inf)"
            out.append(f"{key}.{name}={value!r}: expected a value in {bound}")
    return out


def _layout_problems(name: str, teacher: DistillationTeacherConfig) -> list[str]:
    key = f"{SECTION}.teacher_models.{name}"
    out = []
    if not (teacher.model_path or teacher.load_dir):
        out.append(f"{key}.model_path: expected the teacher's HF directory (or {key}.load_dir), got null")
    inference = teacher.inference
    for field in (
        "tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size", "expert_parallel_size",
        "max_num_seqs", "max_num_batched_tokens",
    ):  # fmt: skip
        value = getattr(inference, field)
        if not (isinstance(value, int) and value >= 1):
            out.append(f"{key}.inference.{field}={value!r}: expected an integer >= 1")
    if inference.max_model_len is not None and not inference.max_model_len >= 2:
        out.append(f"{key}.inference.max_model_len={inference.max_model_len!r}: expected null or an integer >= 2")
    if not 0 < inference.gpu_memory_utilization <= 1:
        out.append(f"{key}.inference.gpu_memory_utilization={inference.gpu_memory_utilization!r}: expected (0, 1]")
    if teacher.num_replicas < 0:
        out.append(f"{key}.num_replicas={teacher.num_replicas!r}: expected an integer >= 0")
    return out


def _routing_problems(d: DistillationConfig) -> list[str]:
    names = list(d.teacher_models)
    if not names:
        return [f"{SECTION}.teacher_models: expected at least one teacher with enabled=true, got none"]
    if len(names) == 1:
        return []
    out = []
    if SINGLE_TEACHER in names:  # verl drops this entry silently when there are others
        out.append(
            f"{SECTION}.teacher_models.{SINGLE_TEACHER}: with several teachers each needs its own entry name (verl"
            f" drops '{SINGLE_TEACHER}' then); rename it"
        )
    seen: dict[str, str] = {}
    for name, teacher in d.teacher_models.items():
        if not teacher.key:
            out.append(
                f"{SECTION}.teacher_models.{name}.key: expected the {SECTION}.teacher_key value ({d.teacher_key}) of"
                " the rows this teacher scores, got null (required with several teachers)"
            )
        elif teacher.key in seen:
            out.append(f"{SECTION}.teacher_models.{name}.key={teacher.key!r}: already the key of {seen[teacher.key]}")
        else:
            seen[teacher.key] = name
    return out


def _pool_problems(d: DistillationConfig) -> list[str]:
    """verl's rule for a separate teacher pool (``n_gpus_per_node x nnodes`` > 0): the teachers fill it exactly."""
    pool = d.n_gpus_per_node * d.nnodes
    if pool == 0 or not d.teacher_models:
        return []
    sizes = {name: _replica_size(t) for name, t in d.teacher_models.items()}
    if len(sizes) == 1:
        (name, size), = sizes.items()  # fmt: skip
        if pool % size:
            return [
                f"{SECTION}.teacher_models.{name}: a replica's {size} devices (TP x DP x PP) must divide the teacher"
                f" pool's {pool} ({SECTION}.n_gpus_per_node x {SECTION}.nnodes)"
            ]
        return []
    total = sum(t.num_replicas * sizes[name] for name, t in d.teacher_models.items())
    if total != pool:
        return [
            f"{SECTION}.teacher_models: num_replicas x (TP x DP x PP) sum to {total} devices, expected the teacher"
            f" pool's {pool} ({SECTION}.n_gpus_per_node x {SECTION}.nnodes)"
        ]
    return []


def _replica_size(teacher: DistillationTeacherConfig) -> int:
    i = teacher.inference
    return max(1, i.tensor_model_parallel_size * i.data_parallel_size * i.pipeline_model_parallel_size)


def distillation_problems(d: DistillationConfig) -> list[str]:
    """Every problem of the ``distillation`` section, one line each naming the key and what is valid. The loss
    section is checked whether or not distillation is enabled (a typo surfaces before it is switched on)."""
    out = []
    for name in ("n_gpus_per_node", "nnodes"):
        value = getattr(d, name)
        if not (isinstance(value, int) and value >= 0):
            out.append(f"{SECTION}.{name}={value!r}: expected an integer >= 0")
    if not d.teacher_key:
        out.append(f"{SECTION}.teacher_key={d.teacher_key!r}: expected the name of a row field (e.g. data_source)")
    out += _loss_problems(d.distillation_loss)
    if not d.enabled:
        return out
    for name, teacher in d.teacher_models.items():
        out += _layout_problems(name, teacher)
    out += _routing_problems(d)
    if not out:
        out += _pool_problems(d)
    return out


def _teacher_layout_problems(name: str, teacher: DistillationTeacherConfig, parallel: Any) -> list[str]:
    """The teacher runs inside the training ranks at the actor's layout: megatron-core holds one parallel state per
    process, so a teacher ``inference`` layout other than the actor's cannot be honoured."""
    key = f"{SECTION}.teacher_models.{name}.inference"
    i = teacher.inference
    pairs = (
        ("tensor_model_parallel_size", i.tensor_model_parallel_size, "parallel.tensor_model_parallel_size",
         parallel.tensor_model_parallel_size),
        ("pipeline_model_parallel_size", i.pipeline_model_parallel_size, "parallel.pipeline_model_parallel_size",
         parallel.pipeline_model_parallel_size),
        ("expert_parallel_size", i.expert_parallel_size, "parallel.expert_model_parallel_size",
         parallel.expert_model_parallel_size),
    )  # fmt: skip
    out = [
        f"{key}.{field}={value}: expected {ours} ({actor_field}): the teacher runs on the training ranks at the"
        " actor's layout (megatron-core holds one parallel layout per process)"
        for field, value, actor_field, ours in pairs
        if value != ours
    ]
    if i.data_parallel_size != 1:
        out.append(
            f"{key}.data_parallel_size={i.data_parallel_size}: expected 1: the teacher runs data-parallel over the"
            " training ranks, as the actor"
        )
    if i.dtype != "auto":
        out.append(f"{key}.dtype={i.dtype!r}: expected 'auto': the teacher runs in the actor's model.params_dtype")
    return out


def distillation_run_problems(
    d: DistillationConfig, parallel: Any, algorithm: Any, trainer: Any, rollout: Any
) -> list[str]:
    """What the colocated teacher stage (``distill/teacher.py``, ``distill/loss_term.py``) cannot honour with
    ``distillation.enabled``: one line each naming the key and the reason."""
    if not d.enabled:
        return []
    out = [p for name, t in d.teacher_models.items() for p in _teacher_layout_problems(name, t, parallel)]
    loss = d.distillation_loss
    if loss_settings(loss.loss_mode).use_topk if loss.loss_mode in DISTILLATION_LOSSES else False:
        out.append(
            f"{SECTION}.distillation_loss.loss_mode={loss.loss_mode!r} with {SECTION}.enabled=true: not wired into"
            " training yet (it needs the teacher's top-k log-probs and the student's whole-vocabulary logits in the"
            " loss hook); use k3/low_var_kl, k2/mse, abs, or k1 with use_policy_gradient=true"
        )
    if d.n_gpus_per_node * d.nnodes > 0 or any(t.num_replicas for t in d.teacher_models.values()):
        out.append(
            f"{SECTION}.n_gpus_per_node/nnodes/teacher_models.*.num_replicas: expected 0: the teachers run on the"
            " training ranks (no separate teacher pool)"
        )
    if len(d.teacher_models) > 1 and d.teacher_key not in ROUTING_FIELDS:
        out.append(
            f"{SECTION}.teacher_key={d.teacher_key!r}: expected one of {', '.join(ROUTING_FIELDS)} (the row fields a"
            " training batch carries) with several teachers"
        )
    if parallel.context_parallel_size != 1:
        out.append(
            f"parallel.context_parallel_size={parallel.context_parallel_size} with {SECTION}.enabled=true: expected 1"
            " (the distillation loss's per-sequence normalisers are not split over context-parallel ranks)"
        )
    if not loss.use_task_rewards and algorithm.filter_groups.enable:
        out.append(
            f"algorithm.filter_groups.enable=true with {SECTION}.distillation_loss.use_task_rewards=false: expected"
            " false: the rewards only feed metrics then, and keeping the groups whose rewards differ would drop"
            " teacher signal for nothing (verl's distillation trainer has no dynamic sampling)"
        )
    if trainer.mode != "sync" or rollout.partial_rollout.enable:
        which = f"trainer.mode={trainer.mode!r}" if trainer.mode != "sync" else "rollout.partial_rollout.enable=true"
        out.append(
            f"{which} with {SECTION}.enabled=true: expected the synchronous colocated step (trainer.mode=sync,"
            " no partial rollout): the teacher stage is built and verified there only"
        )
    return out


def teachers_by_key(d: DistillationConfig) -> dict[str, DistillationTeacherConfig]:
    """The teachers by routing key (verl's ``_resolve_teacher_models``): a single teacher under ``"default"``,
    several under their ``key``. Call on a config :func:`distillation_problems` accepted."""
    if len(d.teacher_models) == 1:
        return {DEFAULT_KEY: next(iter(d.teacher_models.values()))}
    return {t.key: t for t in d.teacher_models.values()}


def teacher_for(teachers: dict[str, DistillationTeacherConfig], row_key: Any, teacher_key: str) -> str:
    """The routing key of the teacher that scores a row whose ``teacher_key`` field is ``row_key``."""
    if set(teachers) == {DEFAULT_KEY}:
        return DEFAULT_KEY
    if row_key not in teachers:
        raise ValueError(
            f"row {teacher_key}={row_key!r}: no teacher for it; {SECTION}.teacher_models keys: {', '.join(teachers)}"
        )
    return row_key
