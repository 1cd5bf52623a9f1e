"""Step 4 of a training step: the log-probs the loss compares against, from the Megatron models.

The old policy is the *proximal* one (the actor's weights before the update) unless ``algorithm.off_policy.mode`` is
``tis``, where it is the *behaviour* policy (the rollout log-probs, no forward). The proximal forward is skipped
when it cannot differ from the update's own forward (``RunPlan.on_policy_update``) and no token of the batch is
stale (partial rollout records each token's policy version; algo/off_policy.py). With on-policy distillation the
teachers score the sampled tokens too (``distill/teacher.py``).
"""

from __future__ import annotations

from typing import Optional

from megatron_dapo.actor.actor import AdapterFreeReference, LogProbModel, MegatronActor
from megatron_dapo.algo.off_policy import is_weight_metrics, staleness_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import ActorConfig, CheckpointConfig, ModelConfig, ParallelConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.distill.teacher import DistillationTeachers
from megatron_dapo.handoff.offload import MemoryHandoff
from megatron_dapo.models.builder import build_gpt_chunks, freeze
from megatron_dapo.models.families import ModelArch
from megatron_dapo.reporting.timing import timed
from megatron_dapo.rollout.sync import logprob_diff_metrics
from megatron_dapo.training.rollout_phase import nonfinite_count
from megatron_dapo.weights.loading import load_mcore_checkpoint


def batch_log_probs(
    batch: TrainBatch,
    actor: MegatronActor,
    ref: Optional[LogProbModel],
    handoff: MemoryHandoff,
    plan: RunPlan,
    version: int,
    temperature: float,
    timings: dict[str, float],
    sum_pi_squared: bool = False,
    teachers: Optional[DistillationTeachers] = None,
) -> dict[str, float]:
    """Fill ``batch.old_log_probs`` (None on the on-policy path), ``batch.ref_log_probs`` (with a reference) and
    ``batch.teacher_log_probs`` (with distillation's ``teachers``);
    ``version`` is the policy version the actor holds. With ``sum_pi_squared`` (the optimal-token-baseline
    estimators) the proximal forward always runs and also fills ``batch.sum_pi_squared``. Returns the staleness,
    mismatch and IS-weight metrics."""
    metrics = staleness_metrics(batch.token_versions, batch.model_mask, version)
    stale = metrics["async/staleness/max"] > 0
    if plan.off_policy_mode == "tis" and not sum_pi_squared:
        batch.old_log_probs = batch.rollout_log_probs
    elif stale or not plan.on_policy_update or sum_pi_squared:
        with timed("old_log_prob", timings):
            old = actor.compute_log_probs(batch, temperature, calculate_sum_pi_squared=sum_pi_squared)
        batch.old_log_probs = old["log_probs"] if plan.off_policy_mode != "tis" else batch.rollout_log_probs
        batch.sum_pi_squared = old.get("sum_pi_squared")
        metrics["perf/padding_ratio/old_log_prob"] = old["padding_ratio"]
        metrics.update(logprob_diff_metrics(old["log_probs"], batch.rollout_log_probs, batch.model_mask))
        metrics.update(nonfinite_count(batch.old_log_probs, batch, "actor/num_nonfinite_old_log_probs"))
        if plan.is_threshold is not None:
            metrics.update(
                is_weight_metrics(batch.old_log_probs, batch.rollout_log_probs, batch.model_mask, plan.is_threshold)
            )
    if ref is not None:
        with timed("ref", timings):
            handoff.before_reference()
            out = ref.compute_log_probs(batch, temperature)
            handoff.after_reference()
        batch.ref_log_probs = out["log_probs"]
        metrics["perf/padding_ratio/ref"] = out["padding_ratio"]
        metrics.update(nonfinite_count(batch.ref_log_probs, batch, "actor/num_nonfinite_ref_log_probs"))
    if teachers is not None:
        with timed("teacher", timings):
            handoff.before_teacher()
            metrics.update(teachers.score(batch))
            handoff.after_teacher()
        metrics.update(nonfinite_count(batch.teacher_log_probs, batch, "actor/num_nonfinite_teacher_log_probs"))
    return metrics


def build_reference(
    model: ModelConfig,
    parallel: ParallelConfig,
    actor_cfg: ActorConfig,
    checkpoint: CheckpointConfig,
    plan: RunPlan,
    arch: ModelArch,
    actor: MegatronActor,
    handoff: MemoryHandoff,
) -> Optional[LogProbModel]:
    """The KL reference (None without a KL term): the frozen model of ``checkpoint.ref_load_dir`` (default
    ``checkpoint.load_dir``), built as the actor is, handed to the memory hand-off; with LoRA the actor with its
    adapters off, no second model. Call it once the engine sleeps (the trainer's start-up order)."""
    if not plan.uses_reference:
        return None
    if actor_cfg.lora.rank:
        return AdapterFreeReference(actor)
    chunks = freeze(build_gpt_chunks(arch, model, parallel, actor_cfg, plan.transformer_impl))
    load_mcore_checkpoint(chunks, arch, checkpoint.ref_load_dir or checkpoint.load_dir)
    ref = MegatronActor.for_plan(chunks, arch.vocab_size, actor_cfg, plan)
    handoff.attach_reference(ref.chunks)
    return ref
