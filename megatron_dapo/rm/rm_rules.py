"""The ``reward.reward_model`` section's rules (``config/rules.py`` runs them with the others): its ranges, and the
layouts and modes the reward model (``docs/reward_model.md``) runs in. Pure: no file is read."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config/rules.py imports this module: the config package is still loading then
    from megatron_dapo.config.schema import ParallelConfig, RewardConfig, TrainerConfig


def reward_model_problems(rw: RewardConfig, parallel: ParallelConfig, trainer: TrainerConfig) -> list[str]:
    """Problem lines naming the field, its value and what is valid; none while ``load_dir`` is unset."""
    rm = rw.reward_model
    if not rm.load_dir:
        return []
    key = "reward.reward_model"
    out = []
    if not (isinstance(rm.weight, (int, float)) and math.isfinite(rm.weight)):
        out.append(f"{key}.weight={rm.weight!r}: expected a finite number")
    for name in ("max_length", "micro_batch_size"):
        value = getattr(rm, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(f"{key}.{name}={value!r}: expected an integer >= 1")
    on = f"{key}.load_dir={rm.load_dir!r}"
    for name in ("pipeline_model_parallel_size", "context_parallel_size"):
        value = getattr(parallel, name)
        if value != 1:
            out.append(
                f"parallel.{name}={value} with {on}: the reward model runs on one pipeline stage without context "
                f"parallelism at the actor's tensor-parallel size; set parallel.{name}=1 or unset {key}.load_dir"
            )
    if trainer.mode != "sync":
        out.append(
            f"trainer.mode={trainer.mode!r} with {on}: the reward model scores on the training ranks of a synchronous"
            f" run only; set trainer.mode=sync or unset {key}.load_dir"
        )
    return out
