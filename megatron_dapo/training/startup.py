"""What every process of a run sets up before its components, the same on both sides of an asynchronous job: the
process groups and the platform, the model's architecture, the tokenizer and its ids, the prompt data and the
number of steps, and the ``RunPlan`` (``config/plan.resolve``: every rule that needs the model, the world or the
platform, checked before any model or engine exists).

``DAPOTrainer`` (``training/trainer.py``) and the async rollout ranks' ``RolloutWorker``
(``training/rollout_worker.py``) start with ``start_run`` and build their components from what it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from megatron_dapo.config import ConfigError, DataConfig, ExperimentConfig, TrainerConfig
from megatron_dapo.config.plan import RunPlan, plan_problems, resolve
from megatron_dapo.config.run_rules import config_platform
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.data import PromptSampler, build_dataset
from megatron_dapo.data.rows import DataError
from megatron_dapo.data.tokens import TokenIds, load_tokenizer, token_ids
from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.parallel import DistInfo, dist_info_from_env, init_distributed, placement
from megatron_dapo.platform import Platform
from megatron_dapo.rollout.multi_turn import tool_schemas
from megatron_dapo.training.group_sources import PromptData
from megatron_dapo.weights.dist_format import hf_config_dir_of

log = logging.getLogger("megatron_dapo.trainer")


@dataclass(frozen=True)
class RunStart:
    """A started process of a run: its side's ranks, the platform, the model's HF directory and architecture, the
    tokenizer and its ids, the prompt data, the number of steps and the resolved run."""

    info: DistInfo
    platform: Platform
    hf_dir: str
    arch: ModelArch
    tokenizer: Any
    ids: TokenIds
    data: PromptData
    total_steps: int
    plan: RunPlan


def start_run(cfg: ExperimentConfig) -> RunStart:
    """Start this process of the run (module docstring). In ``trainer.mode=async`` the job splits into its two
    sides here (``parallel.init_distributed``); the plan is resolved for the whole job on both."""
    world, platform = dist_info_from_env().world_size, config_platform(cfg.parallel)
    try:
        hf_dir = cfg.model.hf_config_dir or str(hf_config_dir_of(cfg.checkpoint.load_dir))
        arch = model_arch_from_hf(hf_dir)
        tokenizer = load_tokenizer(cfg.model.tokenizer_dir, hf_dir)
        data = prompt_data(cfg.data, cfg.rollout.multi_turn, tokenizer)
    except (FileNotFoundError, DataError) as exc:
        # An input that is not there: reported with every problem the rules find without it, as one config error.
        raise ConfigError.of([*plan_problems(cfg, None, world, platform), str(exc)]) from exc
    steps = total_steps(cfg.trainer, data.sampler)
    # train's only gate (every rule once, every problem at once), before any process group exists: the job's world
    # from torchrun's WORLD_SIZE, the answers of the platform the config names (init_distributed sets up the same).
    plan = resolve(cfg, arch, world, platform, total_steps=steps)
    rollout_ranks = cfg.placement.rollout_ranks if cfg.trainer.mode == "async" else 0
    info, platform = init_distributed(cfg.parallel, cfg.trainer.collective_timeout_s, rollout_ranks)
    place = placement()
    if info.is_main and (place is None or place.role == "train"):  # once per job
        for note in plan.notes:
            log.info("%s", note)
    return RunStart(info, platform, hf_dir, arch, tokenizer, token_ids(tokenizer), data, steps, plan)


def prompt_data(data: DataConfig, multi_turn: MultiTurnConfig, tokenizer: Any) -> PromptData:
    """The training and validation prompts (with the tools' schemas in a multi-turn run) and their sampler."""
    tools = tool_schemas(multi_turn)
    train = build_dataset(data.train_files, tokenizer, data, name="train", tools=tools)
    val: Optional[Any] = None
    if data.val_files:
        val = build_dataset(data.val_files, tokenizer, data, name="val", tools=tools)
    gen_batch_size = data.gen_batch_size or data.train_batch_size
    return PromptData(train, val, PromptSampler(len(train), gen_batch_size, data.shuffle, data.seed))


def total_steps(trainer: TrainerConfig, sampler: PromptSampler) -> int:
    """``trainer.total_training_steps``, else ``trainer.total_epochs`` passes over the training prompts."""
    if trainer.total_training_steps is not None:
        return trainer.total_training_steps
    return trainer.total_epochs * len(sampler)
