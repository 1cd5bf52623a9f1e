"""Rule-based rewards: DAPO math, multiple choice, custom functions, overlong shaping and the reward manager.

Modules: ``math_dapo`` and ``choice`` (built-in scorers), ``custom`` (user functions, result checks, time limits, the
worker-side entry), ``overlong`` (DAPO shaping), ``scoring`` (the manager's rules: routing, rows, results),
``workers`` (the supervisor: worker pool, timeouts, crashes, failure counts) and ``manager`` (``RewardManager``,
composing the last two).

Imports are lazy so that reward worker processes (which import ``megatron_dapo.reward.custom``) do not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["InvalidRewardError", "RewardManager", "RewardResult", "load_reward_function", "overlong_penalty"]

_LAZY = {
    "InvalidRewardError": "megatron_dapo.reward.custom",
    "RewardManager": "megatron_dapo.reward.manager",
    "RewardResult": "megatron_dapo.reward.manager",
    "load_reward_function": "megatron_dapo.reward.custom",
    "overlong_penalty": "megatron_dapo.reward.overlong",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # heavy: the manager and overlong modules import torch, which reward worker processes must not load
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
