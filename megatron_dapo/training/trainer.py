"""The DAPO training loop. This file is the only place that knows the order of a step; read ``fit`` top-down.

Every torchrun process runs the same code (SPMD): it holds a slice of the Megatron-Core actor, a slice of the frozen
reference (when a KL term is on) and a member of the colocated vLLM engine. Only rank 0 logs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_dapo.algo.advantages import compute_advantages
from megatron_dapo.algo.dynamic_sampling import DynamicSamplingAccumulator
from megatron_dapo.algo.kl import apply_kl_penalty_to_rewards, get_kl_controller
from megatron_dapo.algo.policy_loss import compute_rollout_is_weights
from megatron_dapo.config import ConfigError, ExperimentConfig, to_dict, validate_parallel_layout
from megatron_dapo.data import PromptSampler, build_dataset
from megatron_dapo.models.builder import build_gpt_chunks, freeze, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import init_distributed, init_model_parallel
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.rollout.engine import RolloutEngine, teardown
from megatron_dapo.rollout.sync import WeightSync, logprob_diff_metrics
from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec
from megatron_dapo.training.actor import MegatronActor
from megatron_dapo.training.checkpoint import CheckpointManager, resolve_resume
from megatron_dapo.training.loggers import MetricsLogger, RolloutDumper
from megatron_dapo.training.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_val_metrics,
    reduce_metrics,
)
from megatron_dapo.training.optimizer import build_optimizer
from megatron_dapo.training.timing import timed
from megatron_dapo.weights.mcore_checkpoint import load_mcore_checkpoint

log = logging.getLogger("megatron_dapo.trainer")

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


class DAPOTrainer:
    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        check_config(cfg)
        self.info, self.platform = init_distributed(cfg.parallel)
        hf_dir = cfg.model.hf_config_dir or str(Path(cfg.checkpoint.load_dir) / "hf_config")
        self.arch = model_arch_from_hf(hf_dir)
        self.dp_size = validate_parallel_layout(
            cfg.parallel,
            self.info.world_size,
            self.arch.num_layers,
            self.arch.num_attention_heads,
            self.arch.num_query_groups,
        )
        init_model_parallel(cfg.parallel, seed=cfg.trainer.seed)

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

        # Models: actor (trainable) and, when a KL term needs it, the frozen reference.
        actor_chunks = build_gpt_chunks(self.arch, cfg)
        load_mcore_checkpoint(actor_chunks, self.arch, cfg.checkpoint.load_dir)
        actor_chunks = wrap_for_training(actor_chunks, cfg)
        optimizer, self.scheduler = build_optimizer(actor_chunks, cfg.actor.optim, self.total_steps)
        self.actor = MegatronActor(actor_chunks, self.arch.vocab_size, cfg.actor, optimizer)
        self.ref: Optional[MegatronActor] = None
        if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            ref_chunks = freeze(build_gpt_chunks(self.arch, cfg))
            load_mcore_checkpoint(ref_chunks, self.arch, cfg.checkpoint.ref_load_dir or cfg.checkpoint.load_dir)
            self.ref = MegatronActor(ref_chunks, self.arch.vocab_size, cfg.actor)
        self.kl_ctrl = get_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.kl_ctrl.target_kl,
            cfg.algorithm.kl_ctrl.horizon,
        )

        # Rollout engine (weights come from the first sync) and the reward manager.
        self.engine = RolloutEngine(cfg, hf_dir, self.platform, pad_token_id=self.pad_id, eos_token_ids=self.eos_ids)
        self.weight_sync = WeightSync(self.engine, self.arch, cfg)
        self.train_sampling = SamplingSpec.for_training(cfg, self.eos_ids)
        self.val_sampling = SamplingSpec.for_validation(cfg, self.eos_ids)
        self.reward = RewardManager(self.tokenizer, cfg.reward, cfg.data.max_response_length, self.eos_ids)

        # Checkpoints, logs.
        out = Path(cfg.trainer.output_dir)
        self.ckpt = CheckpointManager(
            cfg.checkpoint.save_dir or str(out / "checkpoints"), cfg.checkpoint.max_ckpt_to_keep
        )
        main = self.info.is_main
        self.logger = MetricsLogger(
            cfg.trainer.logger,
            str(out),
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            to_dict(cfg),
            enabled=main,
        )
        self.dumper = RolloutDumper(cfg.trainer.rollout_data_dir) if cfg.trainer.rollout_data_dir and main else None
        self.global_step = 0

    # ================================================================================================ the loop

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``; returns the last validation metrics."""
        cfg = self.cfg
        self._maybe_resume()
        self.weight_sync.sync(self.actor.chunks)  # the engine starts from dummy weights
        val_metrics: dict[str, float] = {}
        if self.val_data is not None and cfg.trainer.val_before_train:
            val_metrics = self.validate()
            self.logger.log(val_metrics, step=self.global_step)
        progress = self._progress_bar()
        while self.global_step < self.total_steps:
            self.global_step += 1
            step, timings, metrics = self.global_step, {}, {}
            with timed("step", timings):
                # 1-3. Rollout, rewards, dynamic sampling until the batch is full.
                batch, gen_metrics = self.collect_batch(step, timings)
                metrics.update(gen_metrics)
                # 4. Old-policy (and reference) log-probs from the Megatron models.
                with timed("old_log_prob", timings):
                    old = self.actor.compute_log_probs(batch, cfg.rollout.temperature, calculate_entropy=True)
                batch["old_log_probs"] = old["log_probs"]
                metrics.update(
                    logprob_diff_metrics(old["log_probs"], batch["rollout_log_probs"], batch["response_mask"])
                )
                if self.ref is not None:
                    with timed("ref", timings):
                        batch["ref_log_probs"] = self.ref.compute_log_probs(batch, cfg.rollout.temperature)["log_probs"]
                # 5. Rewards → advantages.
                with timed("adv", timings):
                    metrics.update(self.compute_advantages(batch))
                # 6. Policy update: ppo_epochs × mini-batches through forward_backward_func + optimizer step.
                with timed("update_actor", timings):
                    metrics.update(self.update_actor(batch))
                # 7. Weight sync into the running vLLM engine.
                with timed("update_weights", timings):
                    self.weight_sync.sync(self.actor.chunks)
                # 8. Validation and checkpoint.
                last = step >= self.total_steps
                if (
                    self.val_data is not None
                    and cfg.trainer.test_freq > 0
                    and (step % cfg.trainer.test_freq == 0 or last)
                ):
                    with timed("testing", timings):
                        val_metrics = self.validate()
                    metrics.update(val_metrics)
                if (cfg.checkpoint.save_freq > 0 and step % cfg.checkpoint.save_freq == 0) or last:
                    with timed("save_checkpoint", timings):
                        self.save_checkpoint()
            metrics.update(
                compute_data_metrics(
                    batch,
                    max_prompt_length=cfg.data.max_prompt_length,
                    max_response_length=cfg.data.max_response_length,
                )
            )
            metrics.update(compute_timing_metrics(timings, batch))
            metrics.update(compute_throughput_metrics(batch, timings, self.info.world_size))
            metrics["perf/max_memory_allocated_gb"] = self.platform.max_memory_allocated_gb()
            metrics["perf/cpu_memory_used_gb"] = _rss_gb()
            metrics["training/global_step"] = step
            metrics["training/epoch"] = self.sampler.epoch
            self.logger.log(metrics, step=step)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(score=f"{metrics.get('critic/score/mean', 0):.3f}")
        if progress is not None:
            progress.close()
        return val_metrics

    # ================================================================================================ phases

    def collect_batch(self, step: int, timings: dict) -> tuple[dict, dict]:
        """Generate and score generation batches, keeping informative groups, until the training batch is full."""
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        acc = DynamicSamplingAccumulator(cfg.data.train_batch_size, cfg.rollout.n, enable=fg.enable)
        reward_metrics = []
        while not acc.is_full():
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
            ids = [f"{step}-{acc.num_gen_batches}-{int(i)}" for i in rollout.prompt_index]
            acc.add(gen_batch, ids, gen_batch[_filter_key(fg.metric)] if fg.enable else None)
            acc.check_budget(fg.max_num_gen_batches)
        metrics = dict(acc.metrics())  # before take(), which resets the counters
        batch, group_ids = acc.take(return_group_ids=True)
        batch["group_ids"] = group_ids
        metrics.update(reduce_metrics(reward_metrics))
        if self.dumper is not None:
            self.dumper.dump(step, batch["prompt_text"], batch["response_text"], batch["scores"].tolist())
        return batch, metrics

    def score(self, rollout: RolloutBatch, items: list[dict]) -> tuple[dict, dict]:
        """Rewards on the last response token, overlong shaping/filtering, and per-sample info as batch fields."""
        rows = rollout.prompt_index.tolist()
        result = self.reward(
            rollout.responses,
            rollout.response_mask,
            [items[i]["data_source"] for i in rows],
            [items[i]["ground_truth"] for i in rows],
            [items[i]["extra_info"] for i in rows],
        )
        loss_mask = rollout.response_mask.clone()
        if self.cfg.reward.overlong_filter:
            loss_mask[result.overlong] = 0
        # Fixed widths so that generation batches concatenate; micro-batches are trimmed again in the actor.
        prompt_width, response_width = self.cfg.data.max_prompt_length, self.cfg.data.max_response_length
        batch = {
            "prompts": _pad(rollout.prompts, prompt_width, self.pad_id, left=True),
            "prompt_mask": _pad(rollout.prompt_mask, prompt_width, 0, left=True),
            "responses": _pad(rollout.responses, response_width, self.pad_id),
            "response_mask": _pad(rollout.response_mask, response_width, 0),
            "loss_mask": _pad(loss_mask, response_width, 0),
            "rollout_log_probs": _pad(rollout.rollout_log_probs, response_width, 0.0),
            "truncated": rollout.truncated,
            "token_level_scores": _pad(result.token_level_scores, response_width, 0.0),
            "scores": result.scores,
            "acc": torch.tensor([float(bool(a)) for a in result.extra.get("acc", [None] * len(rows))]),
            "score": torch.tensor([float(s) if s is not None else 0.0 for s in result.extra["score"]]),
            "data_source": [items[i]["data_source"] for i in rows],
        }
        if self.dumper is not None:
            batch["prompt_text"] = [items[i]["raw_prompt"] for i in rows]
            batch["response_text"] = self.tokenizer.batch_decode(
                [r[: int(n)] for r, n in zip(rollout.responses.tolist(), rollout.response_lengths.tolist())],
                skip_special_tokens=True,
            )
        return batch, dict(result.metrics)

    def compute_advantages(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        rewards = batch["token_level_scores"]
        if cfg.algorithm.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty_to_rewards(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch["response_mask"],
                self.kl_ctrl.value,
                cfg.algorithm.kl_penalty,
            )
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size)
            metrics.update(kl_metrics)
        batch["token_level_rewards"] = rewards
        advantages, returns = compute_advantages(
            cfg.algorithm.adv_estimator,
            scores=rewards.sum(-1),
            group_ids=batch["group_ids"],
            response_mask=batch["response_mask"],
            token_level_rewards=rewards,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            gamma=cfg.algorithm.gamma,
        )
        batch["advantages"], batch["returns"] = advantages.float(), returns.float()
        if cfg.algorithm.rollout_is_threshold:
            batch["rollout_is_weights"] = compute_rollout_is_weights(
                batch["old_log_probs"],
                batch["rollout_log_probs"],
                batch["response_mask"],
                cfg.algorithm.rollout_is_threshold,
            )
        return metrics

    def update_actor(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        rows = batch["responses"].shape[0]
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        keys = (
            "prompts",
            "prompt_mask",
            "responses",
            "response_mask",
            "loss_mask",
            "old_log_probs",
            "advantages",
            "ref_log_probs",
            "rollout_is_weights",
        )
        tensors = {k: batch[k] for k in keys if k in batch}
        per_step = []
        for _ in range(cfg.actor.ppo_epochs):
            for start in range(0, rows, mini):
                part = {k: v[start : start + mini] for k, v in tensors.items()}
                per_step.append(self.actor.update(part, cfg.rollout.temperature))
        self.scheduler.step(increment=1)  # the lr schedule counts training steps, not optimizer updates (verl)
        return reduce_metrics(per_step)

    def validate(self) -> dict[str, float]:
        """Generate with the validation sampling parameters on the whole validation set; accuracy per data source."""
        items = [self.val_data[i] for i in range(len(self.val_data))]
        rollout = self.engine.generate([it["input_ids"] for it in items], self.val_sampling, seed_offset=0)
        batch, _ = self.score(rollout, items)
        return compute_val_metrics(batch["data_source"], batch["acc"].tolist(), self.val_sampling.n)

    # ================================================================================================ state

    def save_checkpoint(self) -> None:
        self.ckpt.save(
            step=self.global_step,
            model_chunks=self.actor.chunks,
            optimizer=self.actor.optimizer,
            scheduler=self.scheduler,
            data_state=self.sampler.state_dict(),
            config=to_dict(self.cfg),
            save_optimizer=self.cfg.checkpoint.save_optimizer,
        )

    def _maybe_resume(self) -> None:
        step_dir = resolve_resume(self.cfg.checkpoint.resume_mode, self.ckpt.save_dir)
        if step_dir is None:
            return
        state = self.ckpt.load(step_dir, self.actor.chunks, self.actor.optimizer, self.scheduler)
        self.global_step = int(state["step"])
        self.sampler.load_state_dict(state["data_state"])
        if self.info.is_main:
            log.info("resumed from %s at step %d", step_dir, self.global_step)

    def _total_steps(self) -> int:
        if self.cfg.trainer.total_training_steps is not None:
            return self.cfg.trainer.total_training_steps
        return self.cfg.trainer.total_epochs * len(self.sampler)

    def _progress_bar(self):
        if not (self.info.is_main and self.cfg.trainer.progress_bar):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.global_step, desc="dapo", dynamic_ncols=True)

    def close(self) -> None:
        """Tear down in the order that keeps every group alive until it is no longer used."""
        self.reward.close()
        self.logger.close()
        teardown(self.engine)


# ==================================================================================================== helpers


def check_config(cfg: ExperimentConfig) -> None:
    """Cross-field checks that need no model (the model-dependent ones run once the HF config is read)."""
    if not cfg.checkpoint.load_dir:
        raise ConfigError("checkpoint.load_dir is required: the converter's output (megatron-dapo convert hf-to-mcore)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is required: one or more parquet/jsonl files of prompts")
    if (
        cfg.actor.ppo_mini_batch_size > cfg.data.train_batch_size
        or cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size
    ):
        raise ConfigError(
            f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size} must divide data.train_batch_size="
            f"{cfg.data.train_batch_size}"
        )
    if cfg.algorithm.filter_groups.enable and cfg.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups.enable needs rollout.n >= 2 (groups of one are never filtered)")


def _pad(t: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    """Pad the last dimension of a ``[B, W]`` tensor to ``width`` (on the left for prompts)."""
    extra = width - t.shape[-1]
    if extra < 0:
        raise ValueError(f"batch width {t.shape[-1]} exceeds the configured maximum {width}")
    return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)


def _filter_key(metric: str) -> str:
    return {"acc": "acc", "score": "score", "seq_reward": "scores", "seq_final_reward": "scores"}[metric]


def _eos_ids(tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def _rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def run_training(cfg: ExperimentConfig) -> dict[str, float]:
    """Entry point used by ``megatron-dapo train``: build, fit, tear down (also on errors)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trainer = DAPOTrainer(cfg)
    try:
        started = time.time()
        result = trainer.fit()
        result["wall_s"] = time.time() - started
        return result
    finally:
        trainer.close()
