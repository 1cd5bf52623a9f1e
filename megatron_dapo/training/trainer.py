"""The DAPO training loop. This file is the only place that knows the order of a step; read ``fit`` top-down.

Every torchrun process runs the same code (SPMD): it holds a slice of the Megatron-Core actor, a slice of the frozen
reference (when a KL term is on) and a member of the colocated vLLM engine. Only rank 0 logs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo.algo.advantages import compute_advantages
from megatron_dapo.algo.dynamic_sampling import DynamicSamplingAccumulator
from megatron_dapo.algo.kl import apply_kl_penalty_to_rewards, get_kl_controller
from megatron_dapo.algo.policy_loss import compute_rollout_is_weights
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import ExperimentConfig, to_dict, validate_config
from megatron_dapo.config.plan import resolve
from megatron_dapo.data import PromptSampler, build_dataset
from megatron_dapo.models.builder import build_gpt_chunks, freeze, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import any_rank, control_group, init_distributed, init_model_parallel
from megatron_dapo.reward.manager import RewardManager, RewardResult, merge_results
from megatron_dapo.rollout.engine import RolloutEngine, teardown
from megatron_dapo.rollout.sync import WeightSync, logprob_diff_metrics
from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec
from megatron_dapo.training.actor import MegatronActor
from megatron_dapo.training.checkpoint import CheckpointManager, resolve_resume
from megatron_dapo.training.console import ProgressBar, setup_logging
from megatron_dapo.training.failure import (
    NonFiniteUpdateError,
    PeerFailure,
    StopRequest,
    all_ranks_in_handler,
    record_failure,
)
from megatron_dapo.training.loggers import MetricsLogger, RolloutDumper
from megatron_dapo.training.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_val_metrics,
    reduce_metrics,
)
from megatron_dapo.training.offload import MemoryHandoff
from megatron_dapo.training.optimizer import build_optimizer
from megatron_dapo.training.timing import timed
from megatron_dapo.weights.dist_format import hf_config_dir_of
from megatron_dapo.weights.loading import load_mcore_checkpoint

log = logging.getLogger("megatron_dapo.trainer")


class DAPOTrainer:
    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        validate_config(cfg)
        timeout_s = cfg.trainer.collective_timeout_s
        self.info, self.platform = init_distributed(cfg.parallel, timeout_s=timeout_s)
        hf_dir = cfg.model.hf_config_dir or str(hf_config_dir_of(cfg.checkpoint.load_dir))
        self.arch = model_arch_from_hf(hf_dir)

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_dir or hf_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(self.tokenizer)

        # Data.
        self.train_data = build_dataset(cfg.data.train_files, self.tokenizer, cfg.data, name="train")
        self.val_data = (
            build_dataset(cfg.data.val_files, self.tokenizer, cfg.data, name="val") if cfg.data.val_files else None
        )
        self.gen_batch_size = cfg.data.gen_batch_size or cfg.data.train_batch_size
        self.sampler = PromptSampler(len(self.train_data), self.gen_batch_size, cfg.data.shuffle, cfg.data.seed)
        self.total_steps = self._total_steps()

        # Every check that needs the model, the world size or the step count, before any model or engine exists;
        # what the run derives is resolved here once, and every component reads it from the plan.
        self.plan = resolve(cfg, self.arch, self.info.world_size, self.platform, total_steps=self.total_steps)
        if self.info.is_main:
            for note in self.plan.notes:
                log.info("%s", note)
        self.dp_size = self.plan.dp_size
        init_model_parallel(cfg.parallel, seed=cfg.trainer.seed, timeout_s=timeout_s)

        # Start-up order (verl's): the actor, then the engine with the training state off the device (vLLM checks
        # at construction that gpu_memory_utilization x the device is free), then the reference.
        self._build_actor()
        self.handoff.before_engine_start()
        self.engine = RolloutEngine(
            cfg, hf_dir, self.platform, pad_token_id=self.pad_id, eos_token_ids=self.eos_ids, plan=self.plan
        )  # weights come from the first sync
        self.handoff.after_engine_start(self.engine)
        self._build_reference()
        self._engine_ready_step: Optional[int] = None  # the step whose weights the awake engine holds
        self.kl_ctrl = get_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.kl_ctrl.target_kl,
            cfg.algorithm.kl_ctrl.horizon,
        )
        self.weight_sync = WeightSync(self.engine, self.arch, cfg)
        self.train_sampling = SamplingSpec.for_training(cfg, self.eos_ids)
        self.val_sampling = SamplingSpec.for_validation(cfg, self.eos_ids)
        self.reward = RewardManager(self.tokenizer, cfg.reward, cfg.data.max_response_length, self.eos_ids)

        self._build_outputs()
        # Run state. ``global_step`` is the last *completed* step: its update is applied (what a checkpoint of it
        # holds). ``_boundary`` is the data position and RNG at that point, for a checkpoint after a failure.
        self.global_step = 0
        self.saved_step: Optional[int] = None
        self.num_skipped_updates = 0
        self.consecutive_skipped_updates = 0
        self.num_partial_batches = 0
        self.num_empty_steps = 0  # exhausted steps that kept nothing, so had no update
        self._last_val_step: Optional[int] = None
        self._update_in_progress = False
        self._saving = False
        self._boundary = self._snapshot()
        self.stop_request = StopRequest()

    def _build_actor(self) -> None:
        """The actor (trainable, with its optimizer) and the memory hand-off between it and the engine (what is
        offloaded while vLLM generates; nothing on CPU)."""
        cfg, plan = self.cfg, self.plan
        actor_chunks = build_gpt_chunks(self.arch, cfg, plan.transformer_impl)
        load_mcore_checkpoint(actor_chunks, self.arch, cfg.checkpoint.load_dir)
        actor_chunks = wrap_for_training(actor_chunks, cfg)
        optimizer, self.scheduler = build_optimizer(actor_chunks, cfg.actor.optim, self.total_steps)
        self.actor = MegatronActor(
            actor_chunks, self.arch.vocab_size, cfg.actor, optimizer, packed=plan.use_remove_padding
        )
        self.handoff = MemoryHandoff(self.platform, plan.handoff, self.actor.chunks, self.actor.optimizer)

    def _build_reference(self) -> None:
        """The frozen reference, when a KL term needs it; built once the engine sleeps, handed to the hand-off."""
        cfg = self.cfg
        self.ref: Optional[MegatronActor] = None
        if self.plan.uses_reference:
            ref_chunks = freeze(build_gpt_chunks(self.arch, cfg, self.plan.transformer_impl))
            load_mcore_checkpoint(ref_chunks, self.arch, cfg.checkpoint.ref_load_dir or cfg.checkpoint.load_dir)
            self.ref = MegatronActor(ref_chunks, self.arch.vocab_size, cfg.actor, packed=self.plan.use_remove_padding)
            self.handoff.attach_reference(self.ref.chunks)

    def _build_outputs(self) -> None:
        """Checkpoints, metrics loggers, the progress bar and the rollout dump (rank 0 logs)."""
        cfg = self.cfg
        out = Path(cfg.trainer.output_dir)
        # What a checkpoint holds besides the actor, its optimizer and lr schedule (and every rank's RNG): the state
        # of each component that has one, saved and restored by the manager.
        self.ckpt = CheckpointManager(
            cfg.checkpoint.save_dir or str(out / "checkpoints"),
            cfg.checkpoint.max_ckpt_to_keep,
            timeout_s=cfg.trainer.collective_timeout_s,
            states={"trainer": self, "kl_ctrl": self.kl_ctrl, "data_state": self.sampler},
        )
        main = self.info.is_main
        self.progress = ProgressBar(self.total_steps, 0, enabled=main and cfg.trainer.progress_bar)
        self.logger = MetricsLogger(
            cfg.trainer.logger,
            str(out),
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            to_dict(cfg),
            enabled=main,
            console_every=cfg.trainer.console_every,
            total_steps=self.total_steps,
            verbose=cfg.trainer.verbose,
            progress=self.progress,
        )
        self.dumper = RolloutDumper(cfg.trainer.rollout_data_dir) if cfg.trainer.rollout_data_dir and main else None

    # ================================================================================================ the loop

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``; returns the last validation metrics.

        Ends early, cleanly (checkpoint, exit 0), on SIGTERM/SIGINT or when dynamic sampling is exhausted with
        ``on_exhausted=stop``. Any other failure saves the last completed step (unless it is saved already or the
        failure interrupted its parameter update) and re-raises.
        """
        self._maybe_resume()
        if self.global_step >= self.total_steps:
            if self.info.is_main:
                log.warning(
                    "nothing to do: the run is complete (resumed at step %d, trainer.total_training_steps=%d); "
                    "raise trainer.total_training_steps to train further",
                    self.global_step,
                    self.total_steps,
                )
            return {}
        self.stop_request.install()
        try:
            return self._train_loop()
        except BaseException as exc:
            self._save_after_failure(exc)
            raise
        finally:
            self.stop_request.restore()

    def _train_loop(self) -> dict[str, float]:
        cfg = self.cfg
        val_metrics: dict[str, float] = {}
        if self.val_data is not None and cfg.trainer.val_before_train:
            val_metrics = self.validate()
            self.logger.log(val_metrics, step=self.global_step)
            self._last_val_step = self.global_step
        self.progress.start_at(self.global_step)
        while self.global_step < self.total_steps:
            step_val = self.train_step(self.global_step + 1)
            if step_val is None:  # dynamic sampling exhausted with on_exhausted=stop
                return self._stop_early("dynamic sampling was exhausted (algorithm.filter_groups.on_exhausted=stop)")
            val_metrics = step_val or val_metrics
            if any_rank(self.stop_request.requested):
                return self._stop_early(f"a stop was requested ({self.stop_request.signal_name or 'signal'} on a rank)")
        return val_metrics

    def train_step(self, step: int) -> Optional[dict[str, float]]:
        """One training step, logged. Returns its validation metrics ({} when it did not validate), or None when
        dynamic sampling was exhausted and ``on_exhausted=stop`` (nothing of this step was applied)."""
        cfg = self.cfg
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        val_metrics: dict[str, float] = {}
        with timed("step", timings):
            # 1-3. Rollout, rewards, dynamic sampling until the batch is full (or exhausted).
            collected = self.collect_batch(step, timings)
            if collected is None:
                return None
            batch, gen_metrics = collected
            metrics.update(gen_metrics)
            if bool(batch.loss_mask.any()):
                # 4. Old-policy (and reference) log-probs from the Megatron models.
                metrics.update(self.compute_log_probs(batch, timings))
                # 5. Rewards → advantages.
                with timed("adv", timings):
                    metrics.update(self.compute_advantages(batch))
                # 6. Policy update: ppo_epochs × mini-batches through forward_backward_func + guarded optimizer step.
                # (7. The new weights reach the vLLM engine when it is next needed: _prepare_engine.)
                with timed("update_actor", timings):
                    self.handoff.before_update()
                    metrics.update(self.update_actor(batch, step))
                    self.handoff.end_step()
            else:
                # Exhausted with nothing kept: no update (the weights and the engine stay as they are).
                self.num_empty_steps += 1
                batch.advantages = torch.zeros_like(batch.token_level_scores)
                batch.returns = torch.zeros_like(batch.token_level_scores)
                self.global_step = step
                self._boundary = self._snapshot()
            metrics["train/skipped_updates"] = float(self.num_empty_steps)
            # 8. Validation and checkpoint.
            last = step >= self.total_steps
            if self.val_data is not None and cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                with timed("testing", timings):
                    val_metrics = self.validate(timings)
                metrics.update(val_metrics)
            if (cfg.checkpoint.save_freq > 0 and step % cfg.checkpoint.save_freq == 0) or last:
                with timed("save_checkpoint", timings):
                    self.save_checkpoint()
        metrics.update(self._step_metrics(step, batch, timings))
        self.logger.log(metrics, step=step)
        self.progress.update(metrics)
        if val_metrics:
            self._last_val_step = step
        return val_metrics

    def _step_metrics(self, step: int, batch: TrainBatch, timings: dict[str, float]) -> dict[str, float]:
        """Data, timing, throughput and memory metrics of a finished step (verl's names)."""
        cfg = self.cfg
        metrics = compute_data_metrics(
            batch, max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length
        )
        metrics.update(compute_timing_metrics(timings, batch))
        metrics.update(compute_throughput_metrics(batch, timings, self.info.world_size))
        metrics.update(self.handoff.metrics())
        metrics["perf/max_memory_allocated_gb"] = self.platform.max_memory_allocated_gb()
        metrics["perf/cpu_memory_used_gb"] = self.platform.host_memory_used_gb()
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.sampler.epoch
        return metrics

    def _stop_early(self, why: str) -> dict[str, float]:
        """End the run cleanly at the last completed step: final validation (unless that step has one), a
        checkpoint (unless it is saved), and a message saying why."""
        val_metrics: dict[str, float] = {}
        if self.val_data is not None and self._last_val_step != self.global_step:
            val_metrics = self.validate()
            self.logger.log(val_metrics, step=self.global_step)
        if self.global_step > 0 and self.saved_step != self.global_step:
            self.save_checkpoint()
        if self.info.is_main:
            log.warning(
                "stopping after step %d of %d: %s; the last checkpoint is step %s in %s",
                self.global_step,
                self.total_steps,
                why,
                self.saved_step,
                self.ckpt.save_dir,
            )
        return val_metrics

    # ================================================================================================ phases

    def collect_batch(self, step: int, timings: dict) -> Optional[tuple[TrainBatch, dict]]:
        """Generate and score generation batches, keeping informative groups, until the training batch is full.

        When dynamic sampling is exhausted (``max_num_gen_batches`` generation batches, or one pass over the
        training prompts when that is 0) ``on_exhausted`` decides: ``train`` returns what was kept, filled up with
        dropped (all-equal, zero-advantage) groups whose loss mask is zero; ``stop`` returns None; ``error`` raises.
        """
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        acc = DynamicSamplingAccumulator(cfg.data.train_batch_size, cfg.rollout.n, enable=fg.enable)
        budget = fg.max_num_gen_batches or -(-len(self.train_data) // self.gen_batch_size)
        reward_metrics = []
        self._prepare_engine(timings)
        while not acc.is_full() and not acc.is_exhausted(budget):
            items = [self.train_data[i] for i in self.sampler.next_batch()]
            with timed("gen", timings):
                rollout = self.engine.generate(
                    [it["input_ids"] for it in items],
                    self.train_sampling,
                    seed_offset=step * 1000 + acc.num_gen_batches,
                )
            with timed("reward", timings):
                gen_batch, rmetrics = self.score(rollout, items)
            reward_metrics.append(rmetrics)
            reward_metrics.append(
                _nonfinite_count(gen_batch.rollout_log_probs, gen_batch, "rollout/num_nonfinite_log_probs")
            )
            ids = [f"{step}-{acc.num_gen_batches}-{int(i)}" for i in rollout.prompt_index]
            acc.add(gen_batch, ids, _filter_metric(gen_batch, fg.metric) if fg.enable else None)
        self.handoff.after_rollout(self.engine)  # the engine sleeps until the next rollout or validation
        self._engine_ready_step = None
        metrics = dict(acc.metrics())  # before take(), which resets the counters
        metrics.update(reduce_metrics(reward_metrics))
        if acc.is_full():
            batch, group_ids = acc.take(return_group_ids=True)
            batch.filler = torch.zeros(len(group_ids), dtype=torch.bool)
            metrics["train/partial_batch"] = 0.0
        elif fg.on_exhausted == "error":
            acc.check_budget(budget)
        elif fg.on_exhausted == "stop":
            return None
        else:
            batch, group_ids = self._partial_batch(step, acc, metrics)
        batch.group_ids = group_ids
        if self.dumper is not None:
            self.dumper.dump(step, batch.prompt_text, batch.response_text, batch.seq_rewards.tolist())
        return batch, metrics

    def _partial_batch(
        self, step: int, acc: DynamicSamplingAccumulator, metrics: dict[str, float]
    ) -> tuple[TrainBatch, list]:
        """``on_exhausted=train``: the kept groups, filled up with dropped ones that stay out of the loss."""
        batch, group_ids, filler = acc.take_partial()
        batch.loss_mask[filler] = 0
        batch.filler = filler
        self.num_partial_batches += 1
        metrics["train/partial_batch"] = 1.0
        if self.info.is_main:
            log.warning(
                "step %d: dynamic sampling exhausted after %d generation batches with %d of %d prompts kept; "
                "training on those (algorithm.filter_groups.on_exhausted=train)%s",
                step,
                int(metrics["train/num_gen_batches"]),
                int(metrics["train/num_prompts_kept"]),
                self.cfg.data.train_batch_size,
                "" if bool(batch.loss_mask.any()) else ": none, so the update is skipped",
            )
        return batch, group_ids

    def score(self, rollout: RolloutBatch, items: list[dict]) -> tuple[TrainBatch, dict]:
        """The rollout as a ``TrainBatch``: rewards on the last response token, overlong shaping/filtering, and
        per-sample info."""
        rows = rollout.prompt_index.tolist()
        result = self._score_once(
            rollout.responses,
            rollout.response_mask,
            [items[i]["data_source"] for i in rows],
            [items[i]["ground_truth"] for i in rows],
            [items[i]["extra_info"] for i in rows],
        )
        loss_mask = rollout.response_mask.clone()
        if self.cfg.reward.overlong_filter:
            loss_mask[result.overlong] = 0
        batch = TrainBatch(
            prompts=rollout.prompts,
            prompt_mask=rollout.prompt_mask,
            responses=rollout.responses,
            response_mask=rollout.response_mask,
            loss_mask=loss_mask,
            rollout_log_probs=rollout.rollout_log_probs,
            truncated=rollout.truncated,
            token_level_scores=result.token_level_scores,
            seq_rewards=result.scores,
            verifier_scores=torch.tensor([float(s) if s is not None else 0.0 for s in result.extra["score"]]),
            acc=torch.tensor([float(bool(a)) for a in result.extra.get("acc", [None] * len(rows))]),
            data_source=[items[i]["data_source"] for i in rows],
            **(rollout.routed_experts or {}),  # routing replay: the experts vLLM chose per token
        )
        if self.dumper is not None:
            batch.prompt_text = [items[i]["raw_prompt"] for i in rows]
            batch.response_text = self.tokenizer.batch_decode(
                [r[: int(n)] for r, n in zip(rollout.responses.tolist(), rollout.response_lengths.tolist())],
                skip_special_tokens=True,
            )
        return batch, dict(result.metrics)

    def _score_once(self, responses, response_mask, sources, truths, extras) -> RewardResult:
        """Every response is scored once, on one rank (rows dealt round-robin), and every rank gets all results
        (one object gather on the CPU control group), so ranks agree on rewards — timeouts included — and on what
        dynamic sampling keeps. A scorer failure on any rank is raised on every rank."""
        world, rank = self.info.world_size, self.info.rank
        if world == 1:
            return self.reward(responses, response_mask, sources, truths, extras)
        mine = list(range(rank, responses.shape[0], world))
        part: object = None
        failure: Optional[BaseException] = None
        if mine:
            try:
                part = self.reward(
                    responses[mine],
                    response_mask[mine],
                    [sources[i] for i in mine],
                    [truths[i] for i in mine],
                    [extras[i] for i in mine],
                )
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - raised here, and named on every other rank
                failure = exc
                part = f"{type(exc).__name__}: {exc}"  # user exception types need not unpickle elsewhere
        parts: list = [None] * world
        dist.all_gather_object(parts, (mine, part), group=control_group())
        if failure is not None:
            raise failure
        for source_rank, (_, result) in enumerate(parts):
            if isinstance(result, str):
                raise RuntimeError(f"reward scoring failed on rank {source_rank}: {result}")
        return merge_results([(rows, result) for rows, result in parts if rows], responses.shape[0])

    def compute_log_probs(self, batch: TrainBatch, timings: dict[str, float]) -> dict[str, float]:
        """``old_log_probs`` and ``ref_log_probs`` from the Megatron models. The old-policy forward is skipped when it
        cannot differ from the update's own forward (``actor.old_log_prob_forward``)."""
        temperature = self.cfg.rollout.temperature
        metrics: dict[str, float] = {}
        if not self.plan.on_policy_update:
            with timed("old_log_prob", timings):
                old = self.actor.compute_log_probs(batch, temperature)
            batch.old_log_probs = old["log_probs"]
            metrics["perf/padding_ratio/old_log_prob"] = old["padding_ratio"]
            metrics.update(logprob_diff_metrics(old["log_probs"], batch.rollout_log_probs, batch.response_mask))
            metrics.update(_nonfinite_count(batch.old_log_probs, batch, "actor/num_nonfinite_old_log_probs"))
        if self.ref is not None:
            with timed("ref", timings):
                self.handoff.before_reference()
                ref = self.ref.compute_log_probs(batch, temperature)
                self.handoff.after_reference()
            batch.ref_log_probs = ref["log_probs"]
            metrics["perf/padding_ratio/ref"] = ref["padding_ratio"]
            metrics.update(_nonfinite_count(batch.ref_log_probs, batch, "actor/num_nonfinite_ref_log_probs"))
        return metrics

    def compute_advantages(self, batch: TrainBatch) -> dict[str, float]:
        """``token_level_rewards`` (scores, minus the KL penalty with ``use_kl_in_reward``), ``advantages`` and
        ``returns``, and the truncated-IS weights when the old-policy log-probs exist (else the update computes
        them from its own forward)."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        rewards = batch.token_level_scores
        if cfg.algorithm.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty_to_rewards(
                rewards,
                batch.old_log_probs,
                batch.ref_log_probs,
                batch.response_mask,
                self.kl_ctrl.value,
                cfg.algorithm.kl_penalty,
            )
            # verl passes the number of responses (batch rows) as n_steps.
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=int(rewards.shape[0]))
            metrics.update(kl_metrics)
        batch.token_level_rewards = rewards
        trained_rows = ~batch.filler
        advantages, returns = compute_advantages(
            cfg.algorithm.adv_estimator,
            scores=rewards.sum(-1),
            group_ids=batch.group_ids,
            # Filler groups of an exhausted step are not trained: keep them out of batch-level statistics.
            response_mask=batch.response_mask * trained_rows.unsqueeze(-1),
            token_level_rewards=rewards,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            gamma=cfg.algorithm.gamma,
        )
        batch.advantages, batch.returns = advantages.float(), returns.float()
        if cfg.algorithm.rollout_is_threshold and batch.old_log_probs is not None:
            batch.rollout_is_weights = compute_rollout_is_weights(
                batch.old_log_probs,
                batch.rollout_log_probs,
                batch.response_mask,
                cfg.algorithm.rollout_is_threshold,
            )
        return metrics

    def update_actor(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """``ppo_epochs`` × mini-batches of guarded optimizer steps. A skipped update (non-finite loss, gradient
        norm or loss inputs) changes nothing; too many in a row stop the run with ``NonFiniteUpdateError``."""
        cfg = self.cfg
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        per_step = []
        applied = 0
        self._update_in_progress = True
        for _ in range(cfg.actor.ppo_epochs):
            for start in range(0, len(batch), mini):
                part = batch.select(slice(start, start + mini))
                if not bool(part.loss_mask.any()):
                    continue  # only filler rows: nothing to train, so no optimizer step (Adam would still move)
                metrics = self.actor.update(
                    part, cfg.rollout.temperature, cfg.algorithm.rollout_is_threshold, cfg.data.max_response_length
                )
                nonfinite = metrics.pop("nonfinite")
                if nonfinite:
                    self._on_skipped_update(step, nonfinite)
                else:
                    applied += 1
                    self.consecutive_skipped_updates = 0
                per_step.append(metrics)
        if applied:
            self.scheduler.step(increment=1)  # the lr schedule counts training steps, not optimizer updates (verl)
        # The step's update is complete: this is what a checkpoint of ``step`` holds.
        self.global_step = step
        self._update_in_progress = False
        self._boundary = self._snapshot()
        out = reduce_metrics(per_step) if per_step else {}
        out["actor/num_skipped_updates"] = float(self.num_skipped_updates)
        return out

    def _on_skipped_update(self, step: int, nonfinite: list[str]) -> None:
        self.num_skipped_updates += 1
        self.consecutive_skipped_updates += 1
        limit = self.cfg.trainer.max_consecutive_skipped_updates
        what = ", ".join(nonfinite)
        if self.info.is_main:
            log.warning(
                "step %d: update skipped, not finite: %s (%d in a row; the run stops at "
                "trainer.max_consecutive_skipped_updates=%d)",
                step,
                what,
                self.consecutive_skipped_updates,
                limit,
            )
        if self.consecutive_skipped_updates >= limit:
            self._update_in_progress = False  # nothing was applied: the state is still that of the last good step
            raise NonFiniteUpdateError(
                f"step {step}: {self.consecutive_skipped_updates} consecutive updates skipped because {what} was "
                f"not finite (trainer.max_consecutive_skipped_updates={limit}); the run stops without saving, so "
                f"the last checkpoint (step {self.saved_step}) stays latest in {self.ckpt.save_dir}. Lower "
                "actor.optim.lr, check actor.optim.clip_grad, or look for a broken reward or data rows"
            )

    def _prepare_engine(self, timings: Optional[dict] = None) -> None:
        """Wake the engine with the actor's current weights (the memory hand-off's rollout side, weight sync
        included), unless it is awake with them already (a validation just before)."""
        timings = timings if timings is not None else {}
        if self._engine_ready_step == self.global_step:
            timings.setdefault("update_weights", 0.0)  # synced already (by the validation that ended the last step)
            return
        with timed("update_weights", timings):
            self.handoff.before_rollout(self.engine, lambda: self.weight_sync.sync(self.actor.chunks))
        self._engine_ready_step = self.global_step

    def validate(self, timings: Optional[dict] = None) -> dict[str, float]:
        """Generate with the validation sampling parameters on the whole validation set; accuracy per data source.
        The engine is left awake with the current weights for the next rollout."""
        self._prepare_engine(timings)
        items = [self.val_data[i] for i in range(len(self.val_data))]
        rollout = self.engine.generate([it["input_ids"] for it in items], self.val_sampling, seed_offset=0)
        batch, _ = self.score(rollout, items)
        return compute_val_metrics(batch.data_source, batch.acc.tolist(), self.val_sampling.n)

    # ================================================================================================ state

    # The run's counters, checkpointed as the ``trainer`` component (the step itself is the checkpoint's ``step``). A
    # checkpoint saved before they were leaves them at 0.
    STATE_FIELDS = ("num_skipped_updates", "consecutive_skipped_updates", "num_partial_batches", "num_empty_steps")

    def state_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in self.STATE_FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in self.STATE_FIELDS:
            if name in state:
                setattr(self, name, int(state[name]))

    def save_checkpoint(self) -> None:
        self._saving = True
        # A save reads the actor's parameters and optimizer state; the engine sleeps meanwhile (where it can; it is
        # woken and synced again by the next rollout or validation).
        self.handoff.before_save(self.engine)
        if self.engine.asleep:
            self._engine_ready_step = None
        self.ckpt.save(
            step=self.global_step,
            model_chunks=self.actor.chunks,
            optimizer=self.actor.optimizer,
            scheduler=self.scheduler,
            config=to_dict(self.cfg),
            save_optimizer=self.cfg.checkpoint.save_optimizer,
        )
        self.handoff.after_save()
        self._saving = False
        self.saved_step = self.global_step

    def _snapshot(self) -> dict:
        """The registered components' states (counters, KL controller, data position) and the RNG at a step boundary:
        what a checkpoint of that step must hold, though the next step may already have moved them."""
        return {"states": self.ckpt.component_states(), "rng": self.platform.rng_state()}

    def _save_after_failure(self, exc: BaseException) -> None:
        """Keep the last completed step when the loop fails, if that is safe and not done already."""
        step, main = self.global_step, self.info.is_main
        why_not = None
        if isinstance(exc, NonFiniteUpdateError):
            return
        if isinstance(exc, KeyboardInterrupt):
            why_not = "interrupted by a second signal"
        elif self._update_in_progress:
            why_not = f"the failure interrupted step {step + 1}'s parameter update, so no consistent state is left"
        elif self._saving:
            why_not = "the failure happened while saving"
        elif step == 0 or self.saved_step == step:
            return
        if why_not is None and not all_ranks_in_handler(
            self.info.world_size, min(60.0, self.cfg.trainer.collective_timeout_s)
        ):
            why_not = "not every rank reached the failure handler (the others are blocked or gone)"
        if why_not is not None:
            if main:
                log.error(
                    "not saving step %d after the failure: %s; last checkpoint: step %s", step, why_not, self.saved_step
                )
            return
        try:
            self.ckpt.load_component_states(self._boundary["states"])
            self.platform.set_rng_state(self._boundary["rng"])
            self.save_checkpoint()
            if main:
                log.error(
                    "the run failed; saved its last completed step %d to %s before exiting", step, self.ckpt.save_dir
                )
        except Exception as save_exc:  # noqa: BLE001 - the original failure is what the caller raises
            if main:
                log.error("saving step %d after the failure failed too: %r", step, save_exc)

    def _maybe_resume(self) -> None:
        step_dir = resolve_resume(self.cfg.checkpoint.resume_mode, self.ckpt.save_dir)
        if step_dir is None:
            return
        self.handoff.restore_actor()  # the engine sleeps since start-up: the optimizer state can come back
        # Restores the registered components too: the counters, the KL controller, the data position.
        state = self.ckpt.load(step_dir, self.actor.chunks, self.actor.optimizer, self.scheduler)
        self.global_step = self.saved_step = int(state["step"])
        self._boundary = self._snapshot()
        if self.info.is_main:
            log.info("resumed from %s at step %d", step_dir, self.global_step)

    def _total_steps(self) -> int:
        if self.cfg.trainer.total_training_steps is not None:
            return self.cfg.trainer.total_training_steps
        return self.cfg.trainer.total_epochs * len(self.sampler)

    def close(self) -> None:
        """Tear down in the order that keeps every group alive until it is no longer used."""
        self.progress.close()
        self.reward.close()
        self.logger.close()
        teardown(self.engine)


# ==================================================================================================== helpers


def _nonfinite_count(values: torch.Tensor, batch: TrainBatch, metric: str) -> dict[str, float]:
    """How many of ``values``' response tokens are not finite (they also make the step's update skip)."""
    return {metric: float((~torch.isfinite(values[batch.response_mask.bool()])).sum())}


def _filter_metric(batch: TrainBatch, metric: str) -> torch.Tensor:
    """``algorithm.filter_groups.metric`` per row. Groups are filtered before any KL penalty, so ``seq_reward`` and
    ``seq_final_reward`` are the same sequence reward here."""
    return {"acc": batch.acc, "score": batch.verifier_scores}.get(metric, batch.seq_rewards)


def _eos_ids(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def run_training(cfg: ExperimentConfig) -> dict[str, float]:
    """Entry point used by ``megatron-dapo train``: build, fit, tear down (also on errors).

    A failure is reported with its rank. When another rank failed first, this rank raises ``PeerFailure`` naming
    that rank's error instead of its own consequence of it (a closed connection or a collective timeout), so the
    root cause is what a user reads first.
    """
    rank = int(os.environ.get("RANK", 0))
    setup_logging(cfg.trainer.output_dir, rank, verbose=cfg.trainer.verbose)
    trainer: Optional[DAPOTrainer] = None
    try:
        trainer = DAPOTrainer(cfg)
        started = time.time()
        result = trainer.fit()
        result["wall_s"] = time.time() - started
        return result
    except BaseException as exc:
        first = record_failure(rank, exc)
        own = f"{type(exc).__name__}: {exc}"
        if first.startswith(f"rank {rank}: ") or first.split(": ", 1)[-1] == own:  # this rank's, or the same error
            log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
            raise
        log.error("rank %d stops because %s", rank, first)
        raise PeerFailure(f"rank {rank} stopped because another rank failed first: {first}") from exc
    finally:
        if trainer is not None:
            trainer.close()
