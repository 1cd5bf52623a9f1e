"""On-policy distillation's teachers: frozen megatron-core models that score the student's samples (a component).

Each entry of ``distillation.teacher_models`` is built as the KL reference is (``training/logprob_stage.
build_reference``): its ``GPTModel`` chunks from ``model_path``'s config.json (its architecture may differ from the
student's; the tokenizer may not: ``tokenizer_match.check_same_tokenizer``), at the actor's parallel layout
(megatron-core holds one per process; the config gate refuses a teacher ``inference`` layout that differs), its
weights from ``load_dir`` (a Megatron checkpoint, any TP) or, without one, the HF safetensors under ``model_path``,
then handed to the memory hand-off (``MemoryHandoff.attach_teachers``: offloaded as the reference is).

``DistillationTeachers.score`` fills ``batch.teacher_log_probs``: every row goes to the teacher its
``distillation.teacher_key`` field names (``config_checks.teacher_for``; one teacher takes every row), and each
teacher scores its rows with the reference's vocab-parallel chunked log-prob forward (``MegatronActor.
compute_log_probs``) at temperature 1: verl's teacher returns the prompt log-probs of its engine, where the sampling
temperature does not apply.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import ActorConfig, ModelConfig, ParallelConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import DistillationConfig
from megatron_dapo.data.tokens import load_tokenizer
from megatron_dapo.distill.config_checks import DEFAULT_KEY, SECTION, teacher_for, teachers_by_key
from megatron_dapo.distill.tokenizer_match import check_same_tokenizer
from megatron_dapo.models.builder import build_gpt_chunks, freeze
from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.weights.dist_format import hf_config_dir_of
from megatron_dapo.weights.loading import load_mcore_checkpoint

TEACHER_TEMPERATURE = 1.0

__all__ = ["DistillationTeachers", "route_rows", "teacher_hf_dir"]


def teacher_hf_dir(teacher: Any) -> Path:
    """The teacher's HF directory (config.json, tokenizer): ``model_path``, or the one ``load_dir`` carries."""
    return Path(teacher.model_path) if teacher.model_path else hf_config_dir_of(teacher.load_dir)


def route_rows(keys: dict[str, Any], row_keys: Optional[list[Any]], teacher_key: str, rows: int) -> dict[str, list]:
    """The rows each teacher scores, by routing key (``teachers_by_key``'s), in row order; teachers without rows
    are left out. ``row_keys``: the rows' ``teacher_key`` field (None: one teacher, which takes every row)."""
    if set(keys) == {DEFAULT_KEY}:
        return {DEFAULT_KEY: list(range(rows))}
    if row_keys is None:
        raise ValueError(f"{SECTION}: several teachers route rows by {teacher_key}, but the batch carries none")
    out: dict[str, list] = {}
    for i, row_key in enumerate(row_keys):
        out.setdefault(teacher_for(keys, row_key, teacher_key), []).append(i)
    return out


class DistillationTeachers:
    """The run's teachers by routing key, frozen, each a log-prob model at the actor's layout."""

    def __init__(self, models: dict[str, MegatronActor], teacher_key: str, dp_size: int) -> None:
        self.models = models
        self.teacher_key = teacher_key
        self.dp_size = dp_size

    @classmethod
    def build(
        cls,
        d: DistillationConfig,
        model: ModelConfig,
        parallel: ParallelConfig,
        actor_cfg: ActorConfig,
        plan: RunPlan,
        student_tokenizer: Any,
        handoff: Any,
    ) -> Optional[DistillationTeachers]:
        """The teachers of ``d`` (None when distillation is off), built once the engine sleeps, as the reference."""
        if not d.enabled:
            return None
        models, chunks = {}, []
        names = {id(teacher): name for name, teacher in d.teacher_models.items()}
        student_name = model.tokenizer_dir or model.hf_config_dir
        for key, teacher in teachers_by_key(d).items():
            hf_dir = teacher_hf_dir(teacher)
            name = f"{SECTION}.teacher_models.{names[id(teacher)]} ({hf_dir})"
            check_same_tokenizer(student_tokenizer, load_tokenizer(None, hf_dir), student_name, name)
            arch = model_arch_from_hf(hf_dir)
            models[key] = _build_one(arch, teacher, model, parallel, actor_cfg, plan, hf_dir)
            chunks += models[key].chunks
        handoff.attach_teachers(chunks)
        return cls(models, d.teacher_key, plan.dp_size)

    def score(self, batch: TrainBatch) -> dict[str, float]:
        """Fill ``batch.teacher_log_probs`` (``[B, T]``, 0 outside the response) with each row's teacher's log-probs
        of the sampled tokens; returns the padding ratio of the teachers' forwards. Collective: every rank calls it
        with the same batch."""
        routed = route_rows(self.models, batch.data_source, self.teacher_key, len(batch))
        out = torch.zeros(batch.responses.shape, dtype=torch.float32)
        padding = []
        for key, rows in routed.items():
            # the log-prob forward deals rows evenly over data-parallel ranks: fill up with copies of the first
            padded = rows + [rows[0]] * (-len(rows) % self.dp_size)
            result = self.models[key].compute_log_probs(batch.select(padded), TEACHER_TEMPERATURE)
            out[torch.as_tensor(rows, dtype=torch.long)] = result["log_probs"][: len(rows)]
            padding.append(result["padding_ratio"])
        batch.teacher_log_probs = out
        return {"perf/padding_ratio/teacher": sum(padding) / max(len(padding), 1)}


def _build_one(
    arch: ModelArch,
    teacher: Any,
    model: ModelConfig,
    parallel: ParallelConfig,
    actor_cfg: ActorConfig,
    plan: RunPlan,
    hf_dir: Path,
) -> MegatronActor:
    """One frozen teacher: the actor's layout and settings for its own architecture, loaded from ``load_dir`` or
    the HF weights under ``model_path``."""
    teacher_model = dataclasses.replace(model, hf_config_dir=str(hf_dir))
    chunks = freeze(build_gpt_chunks(arch, teacher_model, parallel, actor_cfg, plan.transformer_impl))
    load_mcore_checkpoint(chunks, arch, teacher.load_dir or teacher.model_path)
    return MegatronActor.for_plan(chunks, arch.vocab_size, actor_cfg, plan)
