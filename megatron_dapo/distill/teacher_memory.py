"""The distillation teachers' architectures, read from each teacher's config.json (``model_path``, or the HF config a
``load_dir`` checkpoint carries), for the resolved run: ``config/memory.py``'s term (each teacher's frozen weights at
the actor's layout, as ``distill/teacher.py`` builds them) and the gate's rule that the actor's layout can shard
each teacher (``config/plan.plan_problems``)."""

from __future__ import annotations

from typing import Any

from megatron_dapo.config.run_rules import parallel_layout_problems
from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import hf_config_dir_of

__all__ = ["teacher_archs", "teacher_layout_problems"]

_UNREADABLE = (CheckpointError, FileNotFoundError, OSError, ValueError)


def _arch_of(teacher: Any) -> ModelArch:
    return model_arch_from_hf(teacher.model_path or hf_config_dir_of(teacher.load_dir))


def teacher_archs(d: Any) -> list[ModelArch]:
    """The architecture of every teacher of the ``distillation`` section ``d`` (none when it is off); a teacher
    whose config is not readable here (``check`` away from the files) is left out."""
    if not d.enabled:
        return []
    out = []
    for teacher in d.teacher_models.values():
        try:
            out.append(_arch_of(teacher))
        except _UNREADABLE:
            continue
    return out


def teacher_layout_problems(d: Any, parallel: Any, train_world: int) -> list[str]:
    """Each teacher runs at the actor's layout: its config must be readable and its heads, KV heads, FFN and layers
    must split over the actor's TP and PP (``run_rules.parallel_layout_problems``), one line each naming the teacher.
    Call once the actor's own layout is known good (the world-size rules are the actor's)."""
    if not d.enabled:
        return []
    out = []
    for name, teacher in d.teacher_models.items():
        key = f"distillation.teacher_models.{name}"
        try:
            arch = _arch_of(teacher)
        except _UNREADABLE as exc:
            field = "model_path" if teacher.model_path else "load_dir"
            out.append(f"{key}.{field}={getattr(teacher, field)!r}: the teacher's config.json is not readable ({exc})")
            continue
        found = parallel_layout_problems(
            parallel, train_world, arch.num_layers, arch.num_attention_heads, arch.num_query_groups,
            arch.ffn_hidden_size, num_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        )  # fmt: skip
        out += [f"{key} (the teacher runs at the actor's layout): {problem}" for problem in found]
    return out
