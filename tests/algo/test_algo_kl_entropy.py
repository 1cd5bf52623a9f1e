"""KL estimators, KL controllers, KL-in-reward and entropy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_dapo.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    get_kl_controller,
    kl_penalty,
)
from megatron_dapo.algo.logprobs import response_log_probs
from megatron_dapo.algo.loss_aggregation import agg_loss
from megatron_dapo.algo.masked import masked_mean


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


LP = [-0.5, -2.0, -1.0, -30.0]
REF = [-1.0, -0.5, -1.0, -1.0]


def _ref_kl(kind: str, lp: float, ref: float) -> float:
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_kinds_match_formulas(kind: str) -> None:
    out = kl_penalty(t64([LP]), t64([REF]), kind)
    torch.testing.assert_close(out, t64([[_ref_kl(kind, a, b) for a, b in zip(LP, REF, strict=True)]]))


def test_low_var_kl_clamps() -> None:
    # ref - logp = 29 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    assert kl_penalty(t64([[-30.0]]), t64([[-1.0]]), "low_var_kl").item() == 10.0
    # ref - logp = -50 -> clamped to -20 -> e^-20 + 19 -> clamped to 10
    assert kl_penalty(t64([[0.0]]), t64([[-50.0]]), "k3").item() == 10.0
    assert kl_penalty(t64([[-1.0]]), t64([[-1.0]]), "k3").item() == 0.0


@pytest.mark.parametrize("kind", ["k1+", "kl+", "k3+", "low_var_kl+", "abs+", "k2+", "mse+"])
def test_straight_through_variants(kind: str) -> None:
    lp = t64([LP]).requires_grad_(True)
    ref = t64([REF])
    out = kl_penalty(lp, ref, kind)
    torch.testing.assert_close(out.detach(), kl_penalty(lp.detach(), ref, kind[:-1]))
    (grad,) = torch.autograd.grad(out.sum(), lp)
    torch.testing.assert_close(grad, lp.detach() - ref)  # d/dlp of 0.5 (lp - ref)^2


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown KL kind 'full'"):
        kl_penalty(t64([[0.0]]), t64([[0.0]]), "full")


def test_controllers() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.2, horizon=1000)
    ctl.update(current_kl=0.3, n_steps=100)  # error 0.5 clipped to 0.2 -> x(1 + 0.2 * 0.1)
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=0.19, n_steps=500)  # error -0.05 -> x(1 - 0.05 * 0.5)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.975)
    assert isinstance(get_kl_controller("adaptive", 0.1, 0.2, 10), AdaptiveKLController)
    assert isinstance(get_kl_controller("fixed", 0.1), FixedKLController)
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.1, 0.2, 0)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        get_kl_controller("pid", 0.1)


def test_controller_state_round_trip() -> None:
    # Adaptive: the coefficient reached so far survives JSON (trainer_state.json) bit for bit, and the restored
    # controller continues exactly like the original.
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.2, horizon=1000)
    for kl in (0.3, 0.19, 0.05):
        ctl.update(current_kl=kl, n_steps=96)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state == {"type": "adaptive", "value": ctl.value} and ctl.value != 0.1
    resumed = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.2, horizon=1000)
    resumed.load_state_dict(state)
    assert resumed.value == ctl.value
    ctl.update(current_kl=0.4, n_steps=96)
    resumed.update(current_kl=0.4, n_steps=96)
    assert resumed.value == ctl.value
    # A state without the coefficient's history (saved by a fixed controller) leaves the configured initial value.
    switched = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.2, horizon=1000)
    switched.load_state_dict(FixedKLController(0.3).state_dict())
    assert switched.value == 0.1
    # Fixed: the coefficient is configuration, so a resumed run keeps the one it is configured with.
    fixed = FixedKLController(0.05)
    assert fixed.state_dict() == {"type": "fixed", "value": 0.05}
    fixed.load_state_dict(state)
    fixed.load_state_dict({"type": "fixed", "value": 0.3})
    assert fixed.value == 0.05
    for bad in ({}, {"type": "pid", "value": 1.0}, {"type": "adaptive"}, [0.1]):
        with pytest.raises(ValueError, match="KL controller state"):
            resumed.load_state_dict(bad)


def test_apply_kl_penalty_to_rewards() -> None:
    scores = t64([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    old = t64([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref = t64([[-1.5, -0.5, -1.0], [-1.0, -3.0, -7.0]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_penalty_to_rewards(scores, old, ref, mask, kl_coef=0.1, kind="kl")
    kl = t64([[0.5, -0.5, 0.0], [-1.0, 1.0, 0.0]])  # last token of row 2 is masked
    torch.testing.assert_close(rewards, scores - 0.1 * kl)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.0 / 3 + 0.0 / 2) / 2, abs=1e-9)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    _, metrics = apply_kl_penalty_to_rewards(scores, old, ref, mask, kl_coef=0.1, kind="abs")
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((1.0 / 3 + 2.0 / 2) / 2, rel=1e-7)


# ----------------------------------------------------------------------------- entropy


def _ref_entropy(row: list[float]) -> float:
    m = max(row)
    z = sum(math.exp(x - m) for x in row)
    probs = [math.exp(x - m) / z for x in row]
    return -sum(p * math.log(p) for p in probs if p > 0)


def entropy(logits: torch.Tensor, true_vocab_size: int | None = None, chunk_tokens: int = 64) -> torch.Tensor:
    """The training entropy (``response_log_probs``) of every row of ``logits[B, T, V]``."""
    batch, length, vocab = logits.shape
    index = torch.arange(length).expand(batch, length)
    _, out = response_log_probs(
        logits, index, torch.zeros_like(index), true_vocab_size or vocab, chunk_tokens=chunk_tokens
    )
    return out


def test_entropy_matches_reference_and_is_stable() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g, dtype=torch.float64) * 3
    logits[0, 0] += 1e4  # huge offset: softmax-invariant
    logits[1, 2, 3] = 80.0  # near one-hot
    out = entropy(logits)
    assert out.shape == (3, 4)
    expected = t64([[_ref_entropy(r) for r in b] for b in logits.tolist()])
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(entropy(logits, chunk_tokens=5), out)
    uniform = entropy(torch.zeros(1, 2, 7, dtype=torch.float64))
    torch.testing.assert_close(uniform, t64([[math.log(7)] * 2]))


def test_entropy_ignores_padded_vocabulary() -> None:
    logits = t64([[[0.0, 0.0, 50.0, 50.0]]])
    assert entropy(logits, true_vocab_size=2).item() == pytest.approx(math.log(2))


def test_masked_entropy_and_entropy_loss() -> None:
    logits = torch.zeros(2, 3, 4, dtype=torch.float64)
    logits[1, :, 0] = 100.0  # entropy ~0 for row 1
    mask = t64([[1, 1, 0], [1, 0, 0]])
    value = masked_mean(entropy(logits), mask).item()
    assert value == pytest.approx(2 * math.log(4) / 3, rel=1e-6)
    loss = agg_loss(entropy(logits), mask, "seq-mean-token-mean").item()
    assert loss == pytest.approx(math.log(4) / 2, rel=1e-6)
