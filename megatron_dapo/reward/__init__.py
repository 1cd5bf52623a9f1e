"""Rule-based rewards: DAPO math, multiple choice, custom functions, overlong shaping and the reward manager.

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
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
