"""Off-policy correction (``algorithm.off_policy``): which log-probs become the old policy, the IS weights, and the
resulting DAPO loss and gradient of each mode on a hand-built stale batch, against a float64 reference written
from the formulas (AReaL's decoupled PPO, verl's bypass mode) — the trainer's own path: ``batch_log_probs`` →
``batch_advantages`` → ``dapo_loss``.

The proximal forward is the Megatron actor's (tested in the actor and rollout tests); here it is a recorded
forward that returns fixed proximal log-probs, so the test sees whether, and on what, the trainer runs it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo.kl import FixedKLController
from megatron_dapo.algo.loss import LossNormalisers, dapo_loss
from megatron_dapo.algo.off_policy import staleness_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import ActorConfig, ConfigError, load_config
from megatron_dapo.training.advantage_stage import batch_advantages
from megatron_dapo.training.logprob_stage import batch_log_probs
from tests.config.test_run_plan import tiny_plan
from tests.config.test_run_validation import TINY

PARTIAL = ["rollout.partial_rollout.enable=true"]


class RecordedForward:
    """Stands in for ``MegatronActor.compute_log_probs``: returns ``proximal`` and counts the calls."""

    def __init__(self, proximal: torch.Tensor) -> None:
        self.proximal, self.calls = proximal, 0

    def compute_log_probs(self, batch, temperature, calculate_sum_pi_squared=False):
        self.calls += 1
        return {"log_probs": self.proximal.clone(), "padding_ratio": 0.0}


def stale_batch(versions_behind: int = 1) -> tuple[TrainBatch, dict[str, torch.Tensor]]:
    """Two groups of two responses, widths 5; tokens of versions 3..5 against weights at version 5."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    behaviour = -torch.rand(4, 5, generator=g) * 2 * mask
    proximal = (behaviour + torch.randn(4, 5, generator=g) * 0.6) * mask  # some ratios above 2, some below 0.5
    current = (proximal + torch.randn(4, 5, generator=g) * 0.3) * mask
    versions = torch.full((4, 5), 5) - versions_behind * torch.tensor([[0, 0, 1, 1, 2]] * 4)
    scores = torch.zeros(4, 5)
    for row, (length, reward) in enumerate(zip(mask.sum(1).tolist(), [1.0, 0.0, 0.0, 1.0])):
        scores[row, length - 1] = reward
    batch = TrainBatch(
        prompts=torch.ones(4, 2, dtype=torch.long),
        prompt_mask=torch.ones(4, 2, dtype=torch.long),
        responses=torch.full((4, 5), 7) * mask,
        response_mask=mask,
        rollout_log_probs=behaviour,
        token_versions=versions * mask,
        token_level_scores=scores,
        group_ids=["a", "a", "b", "b"],
        filler=torch.zeros(4, dtype=torch.bool),
    )
    return batch, {"behaviour": behaviour, "proximal": proximal, "current": current, "mask": mask}


def reference_loss(current, old, advantages, mask, weights, cfg: ActorConfig) -> torch.Tensor:
    """verl's dual-clip PPO token loss in float64, times the IS weights, token-mean over the mask."""
    ratio = torch.exp(current - old)
    a = advantages.double()
    clipped = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
    loss = torch.where(a < 0, torch.minimum(clipped, -a * cfg.clip_ratio_c), clipped)
    return (loss * weights * mask).sum() / mask.sum()


@pytest.mark.parametrize("mode", ["decoupled", "tis", "none"])
def test_mode_loss_and_gradient_against_float64(mode):
    plan = tiny_plan(PARTIAL + [f"algorithm.off_policy.mode={mode}"])
    batch, t = stale_batch()
    forward = RecordedForward(t["proximal"])
    metrics = batch_log_probs(batch, forward, None, None, plan, version=5, temperature=1.0, timings={})
    batch_advantages(batch, load_config(TINY, PARTIAL).algorithm, FixedKLController(0.0), plan.is_threshold)

    mask, cfg = t["mask"].double(), ActorConfig()
    behaviour, proximal = t["behaviour"].double(), t["proximal"].double()
    if mode == "tis":  # the behaviour policy is the old one; no proximal forward, no weight
        assert forward.calls == 0 and batch.rollout_is_weights is None
        old, weights = behaviour, torch.ones_like(mask)
    else:  # a stale batch needs the proximal forward even where one update per step could skip it
        assert plan.on_policy_update and forward.calls == 1
        old = proximal
        weights = (
            torch.clamp(torch.exp(proximal - behaviour), max=2.0) if mode == "decoupled" else torch.ones_like(mask)
        )
        assert (batch.rollout_is_weights is not None) == (mode == "decoupled")
    if mode == "decoupled":
        raw = torch.exp(proximal - behaviour)[mask.bool()]
        assert metrics["async/is_weight/mean"] == pytest.approx(float(raw.mean()), rel=1e-6)
        assert metrics["async/is_weight/max"] == pytest.approx(float(raw.max()), rel=1e-6)
        assert metrics["async/is_weight/clip_frac"] == pytest.approx(float((raw > 2.0).double().mean()))
        assert 0 < metrics["async/is_weight/clip_frac"] < 1  # the batch exercises the truncation

    current = t["current"].clone().requires_grad_(True)
    loss, _ = dapo_loss(
        current,
        None,
        loss_mask=batch.loss_mask,
        response_mask=batch.response_mask,
        advantages=batch.advantages,
        cfg=cfg,
        norm=LossNormalisers.of(batch.loss_mask),
        old_log_probs=batch.old_log_probs,
        rollout_log_probs=batch.rollout_log_probs,
        rollout_is_weights=batch.rollout_is_weights,
    )
    loss.backward()
    current64 = t["current"].double().requires_grad_(True)
    expected = reference_loss(current64, old, batch.advantages, mask, weights, cfg)
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(current.grad.double(), current64.grad, rtol=1e-5, atol=1e-7)


def test_modes_differ_on_the_same_batch():
    losses = {}
    for mode in ("decoupled", "tis", "none"):
        plan = tiny_plan(PARTIAL + [f"algorithm.off_policy.mode={mode}"])
        batch, t = stale_batch()
        batch_log_probs(batch, RecordedForward(t["proximal"]), None, None, plan, 5, 1.0, {})
        batch_advantages(batch, load_config(TINY, PARTIAL).algorithm, FixedKLController(0.0), plan.is_threshold)
        loss, _ = dapo_loss(
            t["current"],
            None,
            loss_mask=batch.loss_mask,
            response_mask=batch.response_mask,
            advantages=batch.advantages,
            cfg=ActorConfig(),
            norm=LossNormalisers.of(batch.loss_mask),
            old_log_probs=batch.old_log_probs,
            rollout_is_weights=batch.rollout_is_weights,
        )
        losses[mode] = float(loss)
    assert len({round(v, 6) for v in losses.values()}) == 3, losses


def test_on_policy_batch_skips_the_proximal_forward():
    # No stale token (partial rollout, every token generated by the weights being updated): the update's own forward
    # is the proximal policy, and decoupled's weight min(own / behaviour, 2) is made in the loss from it.
    plan = tiny_plan(PARTIAL)
    batch, t = stale_batch(versions_behind=0)
    forward = RecordedForward(t["proximal"])
    metrics = batch_log_probs(batch, forward, None, None, plan, version=5, temperature=1.0, timings={})
    assert forward.calls == 0 and batch.old_log_probs is None
    assert metrics["async/staleness/max"] == 0.0
    batch_advantages(batch, load_config(TINY, PARTIAL).algorithm, FixedKLController(0.0), plan.is_threshold)
    current64 = t["current"].double().requires_grad_(True)
    current = t["current"].clone().requires_grad_(True)
    loss, _ = dapo_loss(
        current,
        None,
        loss_mask=batch.loss_mask,
        response_mask=batch.response_mask,
        advantages=batch.advantages,
        cfg=ActorConfig(),
        norm=LossNormalisers.of(batch.loss_mask),
        rollout_log_probs=batch.rollout_log_probs,
        rollout_is_threshold=plan.is_threshold,
    )
    loss.backward()
    mask = t["mask"].double()
    weights = torch.clamp(torch.exp(current64.detach() - t["behaviour"].double()), max=2.0) * mask
    expected = reference_loss(current64, current64.detach(), batch.advantages, mask, weights, ActorConfig())
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(current.grad.double(), current64.grad, rtol=1e-5, atol=1e-7)


def test_staleness_metrics_by_hand():
    versions = torch.tensor([[5, 4, 3], [5, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert staleness_metrics(versions, mask, 5) == {"async/staleness/mean": 0.6, "async/staleness/max": 2.0}
    assert staleness_metrics(None, mask, 5) == {"async/staleness/mean": 0.0, "async/staleness/max": 0.0}


def test_plan_resolves_the_mode_and_threshold():
    sync = tiny_plan()
    assert (sync.off_policy_mode, sync.is_threshold, sync.partial) == ("none", None, None)
    assert tiny_plan(["algorithm.rollout_is_threshold=3"]).is_threshold == 3.0  # synchronous TIS as before
    partial = tiny_plan(PARTIAL + ["rollout.partial_rollout.max_segments=3"])
    # tiny_cpu.yaml: max_response_length 4 in 3 segments → ceil(4 / 3) = 2 tokens per segment
    assert (partial.off_policy_mode, partial.is_threshold) == ("decoupled", 2.0)
    assert (partial.partial.segment_length, partial.partial.max_segments) == (2, 3)
    assert tiny_plan(PARTIAL + ["algorithm.off_policy.mode=tis"]).is_threshold is None
    with pytest.raises(ConfigError, match="algorithm.rollout_is_threshold to null"):
        tiny_plan(PARTIAL + ["algorithm.rollout_is_threshold=2"])
    with pytest.raises(ConfigError, match="actor.router_replay=rollout"):
        tiny_plan(PARTIAL + ["actor.router_replay=rollout"])
    with pytest.raises(ConfigError, match="algorithm.off_policy.is_threshold"):
        tiny_plan(["algorithm.off_policy.is_threshold=0.5"])
    with pytest.raises(ConfigError, match="segment_length=4 covers the whole"):
        tiny_plan(PARTIAL + ["rollout.partial_rollout.segment_length=4"])
