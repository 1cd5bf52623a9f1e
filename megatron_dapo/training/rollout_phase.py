"""The rollout side of a step: the engine woken with the actor's current weights (synced once per set of weights),
generation batches generated and scored under dynamic sampling until the training batch is full, and validation.

``weights_step`` below is the training step whose update the actor's weights hold (the trainer's ``global_step``):
the engine is synced again only when it differs from what the engine holds, so a validation at the end of a step
leaves the engine ready for the next step's rollout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingAccumulator, gen_batch_budget
from megatron_dapo.algo.registry import ADV_ESTIMATORS
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import AlgorithmConfig, DataConfig, RolloutConfig
from megatron_dapo.handoff.offload import MemoryHandoff
from megatron_dapo.reporting.loggers import RolloutDumper, turn_extras
from megatron_dapo.reporting.metrics import compute_val_metrics, reduce_metrics
from megatron_dapo.reporting.timing import timed
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.multi_turn import MultiTurnRollout, build_generator
from megatron_dapo.rollout.types import SamplingSpec
from megatron_dapo.training.group_sources import PartialGroups, Round, WholeGroups
from megatron_dapo.training.reward_stage import RolloutScorer, greedy_baselines, score_to_batch
from megatron_dapo.training.startup import RunStart

log = logging.getLogger("megatron_dapo.trainer")


class RolloutPhase:
    """Generation and scoring for the trainer (a ``training/rollout_source.RolloutSource``); the engine's weights are
    kept in step with the actor's. Reads ``rollout.*``, ``data.{max_response_length, train_batch_size}``,
    ``algorithm.*``, and of the started ``run`` its prompt data, tokenizer, stop ids and the plan's partial rollout."""

    def __init__(
        self,
        rollout: RolloutConfig,
        data_cfg: DataConfig,
        algorithm: AlgorithmConfig,
        run: RunStart,
        engine: RolloutEngine,
        sync_weights: Callable[[], None],
        handoff: MemoryHandoff,
        scorer: RolloutScorer,
        dumper: Optional[RolloutDumper] = None,
    ) -> None:
        self.engine, self.handoff, self.scorer, self.data = engine, handoff, scorer, run.data
        self.n, self.batch_size, self.algorithm = rollout.n, data_cfg.train_batch_size, algorithm
        self.partial = run.plan.partial  # None: every response generated whole
        self.sync_weights = sync_weights
        budget, eos = data_cfg.max_response_length, run.ids.eos
        self.train_sampling = SamplingSpec.for_training(rollout, budget, eos)
        self.val_sampling = SamplingSpec.for_validation(rollout, budget, eos)
        self.generator = build_generator(rollout.multi_turn, budget, engine, run.tokenizer)
        conversations = self.generator if isinstance(self.generator, MultiTurnRollout) else None
        self.source = (
            WholeGroups(self.generator, run.data, self.train_sampling, scorer)
            if self.partial is None
            else PartialGroups(engine, run.data, self.train_sampling, self.partial, budget, rollout.n, conversations)
        )
        self.dumper, self.tokenizer, self.is_main = dumper, run.tokenizer, run.info.is_main
        self.engine_weights: Optional[int] = None  # the step whose weights the awake engine holds

    def prepare_engine(self, weights_step: int, timings: Optional[dict] = None) -> None:
        """Wake the engine with the actor's current weights (the memory hand-off's rollout side, weight sync
        included), unless it is awake with them already (a validation just before)."""
        timings = timings if timings is not None else {}
        if self.engine_weights == weights_step:
            timings.setdefault("update_weights", 0.0)  # synced already (by the validation that ended the last step)
            return
        with timed("update_weights", timings):
            self.handoff.before_rollout(self.engine, self.sync_weights)
        self.engine_weights = weights_step

    def engine_released(self) -> None:
        """The engine slept (after a rollout, or before a save): the next use wakes and syncs it again."""
        if self.engine.asleep:
            self.engine_weights = None

    def _score(self, got: Round) -> tuple[TrainBatch, dict]:
        tokenizer = self.tokenizer if self.dumper is not None else None
        return score_to_batch(self.scorer, self.algorithm, got.rollout, got.items, tokenizer, got.scoring)

    def checkpoint_states(self) -> dict[str, Any]:
        """The rollout's checkpoint components: the data position and partial rollout's buffer of unfinished
        responses."""
        states: dict[str, Any] = {"data_state": self.data.sampler}
        if isinstance(self.source, PartialGroups):
            states["rollout_buffer"] = self.source
        return states

    @property
    def epoch(self) -> int:
        return self.data.sampler.epoch

    def before_save(self) -> None:
        """Nothing to gather: the components above are this process's own."""

    def stop_requested(self) -> bool:
        return False  # a signal reaches the trainer's own processes (StopRequest)

    def close(self) -> None:
        self.scorer.close()
        self.generator.close()

    def collect(self, step: int, weights_step: int, timings: dict) -> Optional[tuple[TrainBatch, dict]]:
        """Generate and score rounds of groups (``group_sources``), keeping informative groups, until the training
        batch is full. ``weights_step`` is the policy version the engine generates with.

        When dynamic sampling is exhausted (``max_num_gen_batches`` generation batches, or one pass over the
        training prompts when that is 0) ``on_exhausted`` decides: ``train`` returns what was kept, filled up with
        dropped (all-equal, zero-advantage) groups whose loss mask is zero (``train/partial_batch`` is 1); ``stop``
        returns None; ``error`` raises.
        """
        data, fg = self.data, self.algorithm.filter_groups
        acc = DynamicSamplingAccumulator(self.batch_size, self.n, enable=fg.enable)
        budget = gen_batch_budget(fg.max_num_gen_batches, len(data.train), data.sampler.batch_size)
        reward_metrics = []
        self.prepare_engine(weights_step, timings)
        while not acc.is_full() and not acc.is_exhausted(budget):
            need = self.batch_size - acc.num_prompts_kept
            with timed("gen", timings):
                got = self.source.round(step, weights_step, need, acc.num_gen_batches)
            if got is None:  # a partial-rollout round in which no group ended
                acc.add({}, [])
                continue
            rollout, items, ids = got.rollout, got.items, got.ids
            with timed("reward", timings):  # with reward.overlap_generation, what was left when generation ended
                gen_batch, rmetrics = self._score(got)
            if ADV_ESTIMATORS.needs(self.algorithm.adv_estimator).greedy_baseline:  # ReMax (verl: gen_max)
                with timed("gen_max", timings):
                    seed = step * 1000 + 999
                    gen_batch.reward_baselines = greedy_baselines(
                        self.generator, self.scorer, self.algorithm, rollout, items, self.train_sampling, seed
                    )
            reward_metrics.append(rmetrics)
            reward_metrics.append(
                nonfinite_count(gen_batch.rollout_log_probs, gen_batch, "rollout/num_nonfinite_log_probs")
            )
            acc.add(gen_batch, ids, filter_metric(gen_batch, fg.metric) if fg.enable else None)
        self.handoff.after_rollout(self.engine)  # the engine sleeps until the next rollout or validation
        self.engine_weights = None
        metrics = dict(acc.metrics())  # before take(), which resets the counters
        metrics.update(reduce_metrics(reward_metrics))
        metrics.update(self.source.metrics())
        if acc.is_full():
            batch, group_ids = acc.take(return_group_ids=True)
            batch.filler = torch.zeros(len(group_ids), dtype=torch.bool)
            metrics["train/partial_batch"] = 0.0
        elif fg.on_exhausted == "error":
            acc.check_budget(budget)
        elif fg.on_exhausted == "stop":
            return None
        elif acc.num_prompts_generated == 0:
            raise RuntimeError(
                f"step {step}: no response ended within {acc.num_gen_batches} generation rounds; with "
                f"rollout.partial_rollout a segment of {self.partial.segment_length} tokens is too short for any "
                "response to end in one step: raise rollout.partial_rollout.segment_length, lower max_segments, or "
                "raise algorithm.filter_groups.max_num_gen_batches"
            )
        else:
            batch, group_ids = self._partial_batch(step, acc, metrics)
        batch.group_ids = group_ids
        if self.dumper is not None:
            uids = [str(gid[-1]) for gid in group_ids]  # (generation batch, group id) → the group id
            rewards = batch.seq_rewards.tolist()
            self.dumper.dump(step, batch.prompt_text, batch.response_text, rewards, uids, turn_extras(batch))
        return batch, metrics

    def _partial_batch(
        self, step: int, acc: DynamicSamplingAccumulator, metrics: dict[str, float]
    ) -> tuple[TrainBatch, list]:
        """``on_exhausted=train``: the kept groups, filled up with dropped ones that stay out of the loss."""
        batch, group_ids, filler = acc.take_partial()
        batch.loss_mask[filler] = 0
        batch.filler = filler
        metrics["train/partial_batch"] = 1.0
        if self.is_main:
            warn_partial_batch(step, metrics, self.batch_size, bool(batch.loss_mask.any()))
        return batch, group_ids

    def validate(self, weights_step: int, timings: Optional[dict] = None) -> dict[str, float]:
        """Generate with the validation sampling parameters on the whole validation set; accuracy per data source.
        The engine is left awake with the current weights for the next rollout."""
        self.prepare_engine(weights_step, timings)
        return validation_metrics(self.generator, self.scorer, self.algorithm, self.data.val, self.val_sampling)


def validation_metrics(
    generator: Any, scorer: RolloutScorer, algorithm: AlgorithmConfig, val: Any, sampling: SamplingSpec
) -> dict[str, float]:
    """The whole validation set generated (``generator``: ``rollout/multi_turn.py``'s ``SingleTurn`` or
    ``MultiTurnRollout``) with the validation sampling and scored: accuracy per data source, and the tools' use
    (``val-aux/tool/*``) in a multi-turn run."""
    items = [val[i] for i in range(len(val))]
    generator.metrics()  # the training rounds' counts are reported with their step, not here
    rollout = generator.generate(items, sampling, seed_offset=0)
    batch, _ = score_to_batch(scorer.rule_based(), algorithm, rollout, items)  # accuracy: no model-based term
    metrics = compute_val_metrics(batch.data_source, batch.acc.tolist(), sampling.n)
    metrics.update({f"val-aux/{k}": v for k, v in generator.metrics().items()})
    return metrics


def nonfinite_count(values: torch.Tensor, batch: TrainBatch, metric: str) -> dict[str, float]:
    """How many of ``values``' response tokens are not finite (they also make the step's update skip)."""
    return {metric: float((~torch.isfinite(values[batch.response_mask.bool()])).sum())}


def filter_metric(batch: TrainBatch, metric: str) -> torch.Tensor:
    """``algorithm.filter_groups.metric`` per row. Groups are filtered before any KL penalty, so ``seq_reward`` and
    ``seq_final_reward`` are the same sequence reward here."""
    return {"acc": batch.acc, "score": batch.verifier_scores}.get(metric, batch.seq_rewards)


def warn_partial_batch(step: int, metrics: dict[str, float], batch_size: int, trains_anything: bool) -> None:
    """The console line of a step that trains on a batch dynamic sampling could not fill (``on_exhausted=train``),
    in either mode (``async_phase.RemoteRolloutPhase`` too)."""
    log.warning(
        "step %d: dynamic sampling exhausted after %d generation batches with %d of %d prompts kept; "
        "training on those (algorithm.filter_groups.on_exhausted=train)%s",
        step,
        int(metrics["train/num_gen_batches"]),
        int(metrics["train/num_prompts_kept"]),
        batch_size,
        "" if trains_anything else ": none, so the update is skipped",
    )
