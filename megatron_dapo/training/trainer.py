"""The DAPO training loop. This file is the only place that knows the order of a step; read ``fit`` top-down.

Every torchrun process runs the same code (SPMD): it holds a slice of the Megatron-Core actor, a slice of the frozen
reference (when a KL term is on) and a member of the colocated vLLM engine. Only rank 0 logs. With
``trainer.mode=async`` the last ``placement.rollout_ranks`` processes run ``training/rollout_worker.py`` instead, and
the others this trainer, whose rollout phase is their remote end (``training/async_phase.py``); the step is the same.

``DAPOTrainer(cfg, engine_factory=...)`` builds the colocated engine through the seam of ``rollout/protocol.py``:
vLLM's ``RolloutEngine`` by default, ``testing/standin_engine.StandInEngine`` where vLLM cannot run (the GPU check).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.optimizer import build_optimizer
from megatron_dapo.algo.kl import get_kl_controller
from megatron_dapo.algo.registry import ADV_ESTIMATORS
from megatron_dapo.batch import TrainBatch
from megatron_dapo.checkpointing.checkpoint import CheckpointManager
from megatron_dapo.config import ActorConfig, ConfigError, ExperimentConfig, TrainerConfig, to_dict
from megatron_dapo.distill.loss_term import DistillationLossTerm
from megatron_dapo.distill.teacher import DistillationTeachers
from megatron_dapo.handoff.offload import MemoryHandoff
from megatron_dapo.judge.judge_scorer import JudgeScorer
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.lora import apply_lora
from megatron_dapo.parallel import any_rank, init_model_parallel, placement, role_of, teardown
from megatron_dapo.reporting.console import ProgressBar, setup_logging
from megatron_dapo.reporting.loggers import MetricsLogger, RolloutDumper
from megatron_dapo.reporting.metrics import reduce_metrics, step_metrics
from megatron_dapo.reporting.timing import StartupClock, timed
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.rm.scorer import RewardModelScorer
from megatron_dapo.rollout.engine import RolloutEngine, freeze_heap_before_engine
from megatron_dapo.rollout.protocol import ColocatedEngine, EngineFactory
from megatron_dapo.rollout.remote import BridgeSender
from megatron_dapo.rollout.weight_transfer.factory import build_bridge_push, build_weight_sync
from megatron_dapo.training.advantage_stage import batch_advantages
from megatron_dapo.training.async_phase import RemoteRolloutPhase
from megatron_dapo.training.failure import PeerFailure, StopRequest, dead_peer_report, record_failure
from megatron_dapo.training.logprob_stage import batch_log_probs, build_reference
from megatron_dapo.training.reward_stage import RolloutScorer
from megatron_dapo.training.rollout_phase import RolloutPhase
from megatron_dapo.training.rollout_source import RolloutSource
from megatron_dapo.training.rollout_worker import RolloutWorker
from megatron_dapo.training.run_state import LoraBase, RunCounters, StepCheckpoints, stop_after_skips
from megatron_dapo.training.startup import RunStart, start_run
from megatron_dapo.weights.loading import load_mcore_checkpoint

log = logging.getLogger("megatron_dapo.trainer")


class DAPOTrainer:
    rollout: RolloutSource  # the colocated rollout phase, or the async rollout ranks' remote end

    def __init__(self, cfg: ExperimentConfig, engine_factory: EngineFactory = RolloutEngine) -> None:
        self.startup = StartupClock()  # timing_s/startup/*, logged with the first step
        self.cfg = cfg
        # The process groups, the platform, the tokenizer, the data and the resolved run (training/startup.py): every
        # check that needs the model, the world size or the step count, before any model or engine exists.
        run = start_run(cfg)
        self.info, self.platform, self.arch, self.data, self.plan = run.info, run.platform, run.arch, run.data, run.plan
        self.total_steps = run.total_steps
        init_model_parallel(cfg.parallel, seed=cfg.trainer.seed, timeout_s=cfg.trainer.collective_timeout_s)

        # Start-up order (verl's): the actor, then the engine with the training state off the device (vLLM checks
        # at construction that gpu_memory_utilization x the device is free), then the reference.
        outputs = _outputs(cfg.trainer, to_dict(cfg), self.info.is_main, self.total_steps)
        self.progress, self.logger, self.dumper = outputs
        self.startup.mark("init")  # process groups, tokenizer, data, plan
        self._build_actor()
        self.startup.mark("actor")
        self.engine, self.rollout = self._build_rollout(run, engine_factory)
        self.startup.mark("engine")
        # The frozen reference, when a KL term needs it, built once the engine sleeps (LoRA: the adapter-free actor).
        sections = (cfg.model, cfg.parallel, cfg.actor, cfg.checkpoint)
        self.ref = build_reference(*sections, self.plan, self.arch, self.actor, self.handoff)
        # On-policy distillation's frozen teachers (None without), built and offloaded as the reference.
        d = cfg.distillation
        self.teachers = DistillationTeachers.build(d, *sections[:3], self.plan, run.tokenizer, self.handoff)
        self.startup.mark("reference")
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.counters = RunCounters()
        self.checkpoints = self._build_checkpoints()
        # ``global_step`` is the last *completed* step: its update is applied (what a checkpoint of it holds).
        self.global_step = 0
        self._last_val_step: Optional[int] = None
        self._update_in_progress = False
        self.stop_request = StopRequest(lambda: dead_peer_report(self.ckpt.save_dir))

    def _build_actor(self) -> None:
        """The actor (trainable, with its optimizer) and the memory hand-off between it and the engine (what is
        offloaded while vLLM generates; nothing on CPU)."""
        cfg, plan = self.cfg, self.plan
        actor_chunks = build_gpt_chunks(self.arch, cfg.model, cfg.parallel, cfg.actor, plan.transformer_impl)
        load_mcore_checkpoint(actor_chunks, self.arch, cfg.checkpoint.load_dir)
        if cfg.actor.lora.rank:
            # The base frozen, adapters the only trainable parameters: DDP buckets and the optimizer hold them alone.
            apply_lora(actor_chunks, cfg.actor.lora)
        actor_chunks = wrap_for_training(actor_chunks, cfg.parallel)
        optimizer, self.scheduler = build_optimizer(actor_chunks, cfg.actor.optim, self.total_steps)
        # On-policy distillation: its loss joins the policy loss in the actor's loss hook (distill/loss_term.py).
        d = cfg.distillation
        extra = DistillationLossTerm(d.distillation_loss, cfg.actor.loss_agg_mode) if d.enabled else None
        self.actor = MegatronActor.for_plan(actor_chunks, self.arch.vocab_size, cfg.actor, plan, optimizer, extra)
        self.handoff = MemoryHandoff(self.platform, plan.handoff, self.actor.chunks, self.actor.optimizer)

    def _build_rollout(
        self, run: RunStart, new_engine: EngineFactory
    ) -> tuple[Optional[ColocatedEngine], RolloutSource]:
        """The colocated engine (weights from the first sync) and the rollout phase that keeps it in step with the
        actor; in async mode the engines are on the rollout ranks and the phase is their remote end."""
        cfg, plan, is_main = self.cfg, self.plan, run.info.is_main
        if plan.mode == "async":
            place = placement()
            # Each tensor from its owner; LoRA: the bridge has no adapter path, the weights go merged (factory.py).
            bridge = BridgeSender(place, plan.rollout, self.platform)
            pushes = build_bridge_push(bridge, self.arch, cfg.rollout, cfg.actor.lora)
            push = lambda: pushes.sync(self.actor.chunks)  # noqa: E731 - the one call back into the actor
            parts = (place, push, self.dumper, is_main, bridge.wait)
            return None, RemoteRolloutPhase(cfg.trainer, cfg.data, plan, *parts)
        self.handoff.before_engine_start()  # collects what it released (accelerators) before the heap is frozen
        freeze_heap_before_engine()
        ids = run.ids
        sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
        engine = new_engine(
            *sections, run.hf_dir, self.platform, pad_token_id=ids.pad, eos_token_ids=ids.eos, plan=plan
        )
        self.handoff.after_engine_start(engine)
        # With LoRA the base goes to vLLM once and then the adapters alone, into vLLM's LoRA support.
        weight_sync = build_weight_sync(engine, self.arch, plan, cfg.rollout, cfg.actor.lora)
        reward = RewardManager(run.tokenizer, cfg.reward, cfg.data.max_response_length, list(ids.eos))
        overlap = (engine.tp_rank, engine.tp_size) if plan.reward_overlap else None  # scored while generated
        reward_model = None  # a frozen reward model: one more reward term (rm/scorer.py), built as the engine sleeps
        if cfg.reward.reward_model.load_dir:
            reward_model = RewardModelScorer.build(cfg.reward.reward_model, plan, cfg.model, cfg.parallel, self.handoff)
        judge = None  # a generative judge: its own vLLM engine beside this one (judge/), one more reward term
        if cfg.reward.judge.model_path:
            timeout = cfg.trainer.collective_timeout_s
            judge = JudgeScorer.build(cfg.reward, plan.rollout, self.platform, run.tokenizer, timeout)
        scorer = RolloutScorer(reward, run.info.world_size, run.info.rank, overlap, reward_model, judge)
        sync = lambda: weight_sync.sync(self.actor.chunks)  # noqa: E731 - the one call back into the actor
        phase = RolloutPhase(cfg.rollout, cfg.data, cfg.algorithm, run, engine, sync, self.handoff, scorer, self.dumper)
        return engine, phase

    def _build_checkpoints(self) -> StepCheckpoints:
        """The checkpoints and what they hold besides the actor, its optimizer and lr schedule (and every rank's RNG):
        the state of each component that has one, saved and restored by the manager."""
        cfg = self.cfg
        self.ckpt = CheckpointManager(
            cfg.checkpoint.save_dir or str(Path(cfg.trainer.output_dir) / "checkpoints"),
            cfg.checkpoint.max_ckpt_to_keep,
            timeout_s=cfg.trainer.collective_timeout_s,
            states={"trainer": self.counters, "kl_ctrl": self.kl_ctrl, **self.rollout.checkpoint_states()},
        )
        if cfg.actor.lora.rank:
            self.ckpt.register("lora", LoraBase(cfg.checkpoint.load_dir, cfg.actor.lora))  # checked on resume
        parts = (self.platform, self.handoff, self.rollout.engine_released, self.info.is_main)
        return StepCheckpoints(self.ckpt, cfg.checkpoint, cfg.trainer, to_dict(cfg), *parts, cfg.checkpoint.async_save)

    # ================================================================================================ the loop

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``; returns the last validation metrics.

        Ends early, cleanly (checkpoint, exit 0), on SIGTERM/SIGINT or when dynamic sampling is exhausted with
        ``on_exhausted=stop``. Any other failure saves the last completed step (unless it is saved already or the
        failure interrupted its parameter update) and re-raises.
        """
        resumed = self.checkpoints.resume(self.actor, self.scheduler)
        if resumed is not None:
            self._step_done(resumed)
        if self.global_step >= self.total_steps:
            _nothing_to_do(self.global_step, self.total_steps, self.info.is_main)
            return {}
        self.stop_request.install()
        try:
            val_metrics = self._train_loop()
            self.checkpoints.finish_saves()  # a save still written in the background is published before the end
            return val_metrics
        except BaseException as exc:
            self.checkpoints.save_after_failure(exc, self.global_step, self._update_in_progress, self.save_checkpoint)
            raise
        finally:
            self.stop_request.restore()

    def _train_loop(self) -> dict[str, float]:
        cfg = self.cfg
        val_metrics: dict[str, float] = {}
        if self.data.val is not None and cfg.trainer.val_before_train:
            val_metrics = self.rollout.validate(self.global_step)
            self.logger.log(val_metrics, step=self.global_step)
            self._last_val_step = self.global_step
        self.progress.start_at(self.global_step)
        self.startup.mark_total()  # launch → the first step (whose update_weights is the first sync)
        while self.global_step < self.total_steps:
            step_val = self.train_step(self.global_step + 1)
            if step_val is None:  # dynamic sampling exhausted with on_exhausted=stop
                return self._stop_early("dynamic sampling was exhausted (algorithm.filter_groups.on_exhausted=stop)")
            val_metrics = step_val or val_metrics
            if any_rank(self.stop_request.requested or self.rollout.stop_requested()):
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
            # 1-3. Rollout (the engine synced with the actor's weights first), rewards, dynamic sampling until the
            # batch is full (or exhausted).
            collected = self.rollout.collect(step, self.global_step, timings)
            if collected is None:
                return None
            batch, gen_metrics = collected
            metrics.update(gen_metrics)
            self.counters.num_partial_batches += int(gen_metrics["train/partial_batch"])
            if bool(batch.loss_mask.any()):
                # 4. Old-policy (and reference) log-probs from the Megatron models.
                metrics.update(self.compute_log_probs(batch, timings))
                # 5. Rewards → advantages.
                with timed("adv", timings):
                    metrics.update(batch_advantages(batch, cfg.algorithm, self.kl_ctrl, self.plan.is_threshold))
                # 6. Policy update: ppo_epochs × mini-batches through forward_backward_func + guarded optimizer step.
                # (7. The new weights reach the vLLM engine when it is next needed: RolloutPhase.prepare_engine.)
                with timed("update_actor", timings):
                    self.handoff.before_update()
                    metrics.update(self.update_actor(batch, step))
                    self.handoff.end_step()
            else:
                # Exhausted with nothing kept: no update (the weights and the engine stay as they are).
                self.counters.num_empty_steps += 1
                batch.advantages = torch.zeros_like(batch.token_level_scores)
                batch.returns = torch.zeros_like(batch.token_level_scores)
                self._step_done(step)
            metrics["train/skipped_updates"] = float(self.counters.num_empty_steps)
            # 8. Validation and checkpoint.
            last = step >= self.total_steps
            if self.data.val is not None and cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                with timed("testing", timings):
                    val_metrics = self.rollout.validate(self.global_step, timings)
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
        lengths = (self.cfg.data.max_prompt_length, self.cfg.data.max_response_length)
        metrics = step_metrics(batch, timings, self.startup.pop(), lengths, self.info.world_size)
        metrics.update(self.handoff.metrics())
        metrics["perf/max_memory_allocated_gb"] = self.platform.max_memory_allocated_gb()
        metrics["perf/cpu_memory_used_gb"] = self.platform.host_memory_used_gb()
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.rollout.epoch
        return metrics

    def _stop_early(self, why: str) -> dict[str, float]:
        """End the run cleanly at the last completed step: final validation (unless that step has one), a
        checkpoint (unless it is saved), and a message saying why."""
        val_metrics: dict[str, float] = {}
        if self.data.val is not None and self._last_val_step != self.global_step:
            val_metrics = self.rollout.validate(self.global_step)
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

    def compute_log_probs(self, batch: TrainBatch, timings: dict[str, float]) -> dict[str, float]:
        """The old policy's (proximal or behaviour, per ``algorithm.off_policy``), the reference's and the
        distillation teachers' log-probs."""
        t = self.cfg.rollout.temperature
        sq = ADV_ESTIMATORS.needs(self.cfg.algorithm.adv_estimator).sum_pi_squared
        parts = (self.handoff, self.plan, self.global_step, t, timings, sq, self.teachers)
        return batch_log_probs(batch, self.actor, self.ref, *parts)

    def update_actor(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """``ppo_epochs`` × mini-batches of guarded optimizer steps. A skipped update (non-finite loss, gradient
        norm or loss inputs) changes nothing; too many in a row stop the run with ``NonFiniteUpdateError``."""
        cfg = self.cfg
        per_step = []
        applied = 0
        self._update_in_progress = True
        for part in mini_batches(batch, cfg.actor, cfg.rollout.n):
            result = self.actor.update(
                part, cfg.rollout.temperature, self.plan.is_threshold, cfg.data.max_response_length
            )
            if result.nonfinite:
                limit, main = cfg.trainer.max_consecutive_skipped_updates, self.info.is_main
                why = self.counters.skipped_update(step, list(result.nonfinite), limit, main)
                if why is not None:
                    self._update_in_progress = False  # nothing was applied: the last good step's state stands
                    raise stop_after_skips(why, self.saved_step, self.ckpt.save_dir)
            else:
                applied += 1
                self.counters.applied_update()
            per_step.append(result.metrics)
        if applied:
            self.scheduler.step(increment=1)  # the lr schedule counts training steps, not optimizer updates (verl)
        self._update_in_progress = False
        self._step_done(step)  # the step's update is complete: this is what a checkpoint of ``step`` holds
        out = reduce_metrics(per_step) if per_step else {}
        out["actor/num_skipped_updates"] = float(self.counters.num_skipped_updates)
        return out

    # ================================================================================================ state

    def _step_done(self, step: int) -> None:
        self.global_step = step
        self.checkpoints.mark_boundary()

    def save_checkpoint(self) -> None:
        self.rollout.before_save()
        self.checkpoints.save(self.global_step, self.actor, self.scheduler, self.engine)

    @property
    def saved_step(self) -> Optional[int]:
        return self.checkpoints.saved_step

    def close(self) -> None:
        """Tear down in the order that keeps every group alive until it is no longer used."""
        self.progress.close()
        self.rollout.close()
        self.logger.close()
        self.handoff.close()
        teardown(self.engine)


def mini_batches(batch: TrainBatch, actor_cfg: ActorConfig, n: int) -> Iterator[TrainBatch]:
    """``ppo_epochs`` x the step's mini-batches of ``ppo_mini_batch_size`` prompts (x ``n`` responses), leaving out
    those with only filler rows: nothing to train, so no optimizer step (Adam would still move)."""
    size = actor_cfg.ppo_mini_batch_size * n
    for _ in range(actor_cfg.ppo_epochs):
        for start in range(0, len(batch), size):
            part = batch.select(slice(start, start + size))
            if bool(part.loss_mask.any()):
                yield part


def _nothing_to_do(step: int, total_steps: int, is_main: bool) -> None:
    if is_main:
        log.warning(
            "nothing to do: the run is complete (resumed at step %d, trainer.total_training_steps=%d); "
            "raise trainer.total_training_steps to train further",
            step,
            total_steps,
        )


def _outputs(t: TrainerConfig, run_config: dict, is_main: bool, total_steps: int) -> tuple:
    """The progress bar, the metrics loggers (``run_config``: the whole config, for the loggers that record it) and
    the rollout dump (rank 0 logs)."""
    progress = ProgressBar(total_steps, 0, enabled=is_main and t.progress_bar)
    logger = MetricsLogger(
        t.logger,
        str(Path(t.output_dir)),
        t.project_name,
        t.experiment_name,
        run_config,
        enabled=is_main,
        console_every=t.console_every,
        total_steps=total_steps,
        verbose=t.verbose,
        progress=progress,
    )
    dumper = RolloutDumper(t.rollout_data_dir) if t.rollout_data_dir and is_main else None
    return progress, logger, dumper


def run_training(cfg: ExperimentConfig) -> dict[str, float]:
    """Entry point used by ``megatron-dapo train``: build, fit, tear down (also on errors).

    A failure is reported with its rank. When another rank failed first, this rank raises ``PeerFailure`` naming
    that rank's error instead of its own consequence of it (a closed connection or a collective timeout), so the
    root cause is what a user reads first.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    setup_logging(cfg.trainer.output_dir, rank, verbose=cfg.trainer.verbose)
    rollout_ranks = cfg.placement.rollout_ranks if cfg.trainer.mode == "async" else 0
    trainer: Optional[Any] = None
    try:
        # trainer.mode=async: the last ranks only generate (training/rollout_worker.py), serving the others.
        trainer = RolloutWorker(cfg) if role_of(rank, world, rollout_ranks) == "rollout" else DAPOTrainer(cfg)
        started = time.time()
        result = trainer.fit()
        if isinstance(trainer, RolloutWorker):
            return {}  # the training ranks report the run
        result["wall_s"] = time.time() - started
        return result
    except ConfigError:
        raise  # the same on every rank: the command line prints it once (cli.py)
    except BaseException as exc:
        # A peer that died without a word (SIGKILL, OOM killer) leaves only a broken collective here: name it first.
        death = None if isinstance(exc, KeyboardInterrupt) else dead_peer_report(
            cfg.checkpoint.save_dir or str(Path(cfg.trainer.output_dir) / "checkpoints")
        )
        first = record_failure(rank, exc, cause=death)
        own = f"{type(exc).__name__}: {exc}"
        if death is not None and first == death:
            log.error("%s", death)
            log.error("rank %d stops: %s", rank, own)
            raise PeerFailure(death) from exc
        if first.startswith(f"rank {rank}: ") or first.split(": ", 1)[-1] == own:  # this rank's, or the same error
            log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
            raise
        log.error("rank %d stops because %s", rank, first)
        raise PeerFailure(f"rank {rank} stopped because another rank failed first: {first}") from exc
    finally:
        if trainer is not None:
            trainer.close()
