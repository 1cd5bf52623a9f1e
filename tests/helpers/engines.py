"""The config sections a rollout engine is built from (``RolloutEngine``, ``StandInEngine``, ``EngineFactory``), in
its constructor's order, out of a test's whole config."""

from __future__ import annotations

from megatron_dapo.config import ActorConfig, DataConfig, ExperimentConfig, ModelConfig, RolloutConfig, TrainerConfig


def engine_sections(cfg: ExperimentConfig) -> tuple[RolloutConfig, DataConfig, ModelConfig, ActorConfig, TrainerConfig]:
    return cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer
