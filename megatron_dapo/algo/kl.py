"""KL estimators, KL controllers and the KL-in-reward penalty (verl 0.9.1 semantics).

Shapes: ``[B, T]`` per-token log-probabilities of the sampled tokens. Pure functions, no process groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megatron_dapo.algo.masked import masked_mean

KL_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0  # verl clamps ref_logp - logp to [-20, 20] before exp
LOW_VAR_KL_CLAMP = 10.0  # ... and the k3 estimate to [-10, 10]

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_penalty_to_rewards",
    "get_kl_controller",
    "kl_penalty",
]


def _kl_forward(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_log_prob - log_prob, min=-LOW_VAR_KL_LOG_RATIO_CLAMP, max=LOW_VAR_KL_LOG_RATIO_CLAMP)
        kld = torch.exp(kl) - kl - 1
        return torch.clamp(kld, min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    raise ValueError(
        f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}, optionally with a '+' suffix "
        "(straight-through k2 gradient)"
    )


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` between the policy and the reference (http://joschu.net/blog/kl-approx.html).

    Kinds: ``kl``/``k1``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``mse``/``k2``: ``0.5 (logp - ref)^2``;
    ``low_var_kl``/``k3``: ``exp(d) - d - 1`` with ``d = clamp(ref - logp, -20, 20)``, result clamped to
    ``[-10, 10]``.

    A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``...) gives the straight-through variant: the forward value of
    the named estimator with the gradient of ``k2`` (unbiased KL gradient), as verl 0.9.1. ``k2+``/``mse+`` equal
    ``k2`` (verl computes them through the straight-through path, with the same value and gradient).
    Unknown kinds raise ``ValueError`` (verl: ``NotImplementedError``, also for ``full``, which we do not offer).
    """
    if not kind.endswith("+"):
        return _kl_forward(log_prob, ref_log_prob, kind)
    base = kind[:-1]
    forward = _kl_forward(log_prob, ref_log_prob, base)
    if base in ("mse", "k2"):
        return forward
    backward = 0.5 * (log_prob - ref_log_prob).square()
    return backward - backward.detach() + forward.detach()


def _checked_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or state.get("type") not in ("fixed", "adaptive") or "value" not in state:
        raise ValueError(
            f"KL controller state: expected {{'type': 'fixed' | 'adaptive', 'value': float}}, got {state!r}"
        )
    return state


class FixedKLController:
    """Constant KL coefficient (``value``); ``update`` is a no-op.

    ``state_dict``/``load_state_dict`` (the checkpoint's ``kl_ctrl`` entry): the coefficient is configuration
    (``algorithm.kl_ctrl.kl_coef``), not state, so loading keeps the configured value; a resumed run that changes
    ``kl_coef`` uses the new one.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _checked_state(state)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593), as in verl.

    ``update``: ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    verl calls it once per step with ``n_steps`` = the number of responses in the batch.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """The coefficient reached so far (``target``/``horizon`` are configuration). JSON-safe: a float survives
        ``json`` bit for bit, so a resumed run continues the controller exactly."""
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved adaptive coefficient. A state saved by a fixed controller (the run switched to
        adaptive control) leaves the configured initial coefficient: the fixed value was configuration too."""
        if _checked_state(state)["type"] == "adaptive":
            self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(kl_type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (``fixed`` | ``adaptive``)."""
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got {kl_type!r}")


@torch.no_grad()
def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward (verl ``apply_kl_penalty``): ``rewards = scores - kl_coef * kl * mask``.

    Args:
        token_level_scores, old_log_prob, ref_log_prob, response_mask: ``[B, T]``.
        kl_coef: the controller's current ``value``.
        kind: KL estimator, see :func:`kl_penalty`.

    Returns:
        ``(token_level_rewards[B, T], metrics)`` with ``actor/reward_kl_penalty`` (batch mean of the per-sequence
        masked-mean KL: the ``current_kl`` to pass to ``controller.update(current_kl, n_steps=B)``, which the
        caller does) and ``actor/reward_kl_penalty_coeff`` (``kl_coef``).
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask.to(old_log_prob.dtype)
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, response_mask, axis=-1)
    current_kl = float(per_seq.mean().item()) if per_seq.numel() else 0.0
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(kl_coef)}
