"""The distillation teachers' term in ``config/memory.py``'s model: their architectures, read from each teacher's
config.json (``model_path``, or the HF config a ``load_dir`` checkpoint carries). The model counts each teacher's
frozen weights at the actor's layout (``distill/teacher.py`` builds them so)."""

from __future__ import annotations

from typing import Any

from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import hf_config_dir_of

__all__ = ["teacher_archs"]


def teacher_archs(d: Any) -> list[ModelArch]:
    """The architecture of every teacher of the ``distillation`` section ``d`` (none when it is off); a teacher
    whose config is not readable here (``check`` away from the files) is left out."""
    if not d.enabled:
        return []
    out = []
    for teacher in d.teacher_models.values():
        try:
            source = teacher.model_path or hf_config_dir_of(teacher.load_dir)
            out.append(model_arch_from_hf(source))
        except (CheckpointError, FileNotFoundError, OSError, ValueError):
            continue
    return out
