"""Named, pluggable algorithm parts: advantage estimators and policy-loss variants.

Config validation, dispatch and the implementations meet here: ``algorithm.adv_estimator`` and
``actor.policy_loss`` must name a registered entry, and the built-in ones register themselves where they are defined
(``algo/advantages.py``, ``algo/policy_losses.py``). A user adds their own in a Python file named by
``algorithm.user_algorithms_file``, the way custom reward functions come from ``reward.custom_function.path``::

    from megatron_dapo.algo.registry import register_adv_estimator, register_policy_loss

    @register_adv_estimator("my_grpo")  # needs=EstimatorNeeds(...) when it needs more than the batch
    def my_grpo(inputs):                # AdvantageInputs -> (advantages[B, T], returns[B, T])
        ...

    @register_policy_loss("my_pg")
    def my_pg(inputs):                  # PolicyLossInputs -> {"pg_losses": [B, T], ...}
        return {"pg_losses": -inputs.advantages * inputs.log_prob}

Signatures are documented on :data:`ADV_ESTIMATORS` and :data:`POLICY_LOSSES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

from megatron_dapo.user_code import load_python_file

F = TypeVar("F", bound=Callable)

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "EstimatorNeeds",
    "Registry",
    "load_user_algorithms",
    "register_adv_estimator",
    "register_policy_loss",
]


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the loop beyond the step's batch; the loop asks
    ``ADV_ESTIMATORS.needs(name)`` instead of naming estimators."""

    greedy_baseline: bool = False  # a greedy response's reward per prompt (ReMax: ``reward_baselines``)
    sum_pi_squared: bool = False  # Σ over the vocabulary of π² per token, from the old-policy forward
    reward_components: bool = False  # the reward function's named dimensions [B, K] (``algorithm.gdpo_reward_keys``)


class Registry(Generic[F]):
    """Functions by name, for one config key (``config_key`` is named in every error), each with what it needs."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, F] = {}
        self._needs: dict[str, EstimatorNeeds] = {}

    def register(self, name: str, needs: EstimatorNeeds = EstimatorNeeds()) -> Callable[[F], F]:
        """Decorator registering a function as ``name`` with what it ``needs``. A name is registered once (a second
        one is an error, so a user file cannot silently replace a built-in)."""

        def add(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered already (by {self._entries[name].__module__})")
            self._entries[name] = fn
            self._needs[name] = needs
            return fn

        return add

    def needs(self, name: str) -> EstimatorNeeds:
        """What the entry registered as ``name`` needs (``register``'s ``needs``)."""
        self.get(name)  # the unknown-name error
        return self._needs[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def unknown(self, name: str) -> str:
        """The problem text for an unregistered ``name`` (used by config validation and ``get``)."""
        return (
            f"{self.config_key}={name!r}: no such {self.kind}; registered: {', '.join(self.names())}. Register your "
            f"own with @register_{self.config_key.split('.')[-1]}(name) in a file named by "
            "algorithm.user_algorithms_file"
        )

    def get(self, name: str) -> F:
        if name not in self._entries:
            raise ValueError(self.unknown(name))
        return self._entries[name]


#: ``fn(inputs: AdvantageInputs) -> (advantages[B, T], returns[B, T])`` (``algo/advantages.py``); pure.
ADV_ESTIMATORS: Registry = Registry("advantage estimator", "algorithm.adv_estimator")
#: ``fn(inputs: PolicyLossInputs) -> dict`` (``algo/policy_losses.py``): ``[b, T]`` per-token tensors, unaggregated:
#: ``pg_losses`` (required), the metric terms ``clipped``, ``clipped_lower``, ``approx_kl`` (optional), and optionally
#: ``loss_agg_mode`` (a str the loss imposes). Sequence sums go through ``inputs.sum_rows`` (whole sequences under
#: context parallelism); pure.
POLICY_LOSSES: Registry = Registry("policy loss", "actor.policy_loss")

register_adv_estimator = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register


def load_user_algorithms(path: Optional[str]) -> None:
    """Import ``algorithm.user_algorithms_file`` so that its ``@register_*`` decorators run (no-op for None/"")."""
    if path:
        load_python_file(path, "algorithm.user_algorithms_file")
