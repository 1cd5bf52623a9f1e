"""verl's registered policy losses (``algo/policy_losses.py``) beyond the golden values: exactness of every loss under
a micro-batch/data-parallel split (global normalisers), whole-sequence values under context parallelism (CP 2,
with ``context_parallel_slice`` and the per-position stand-in of ``tests/training/test_batch.py``), the row-sum
helper the actor's hook uses, and the ``actor.policy_loss`` config keys and their validation."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_dapo.algo.loss import LossNormalisers, dapo_loss, loss_metrics, partial_row_sum
from megatron_dapo.algo.loss_aggregation import LOSS_AGG_MODES, PolicyLossInputs
from megatron_dapo.algo.registry import POLICY_LOSSES
from megatron_dapo.batch import TrainBatch, context_parallel_slice, make_micro_batch
from megatron_dapo.config import ActorConfig, ConfigError, config_problems, load_config, raise_if_any
from megatron_dapo.config.schema import PolicyLossConfig, RolloutCorrectionConfig

VERL_LOSSES = (
    "vanilla", "gspo", "geo_mean", "sapo", "cispo", "gpg", "dro", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl",
    "bypass_mode",
)  # fmt: skip
# The settings of each loss in these tests. clip_cov and kl_cov pick their tokens from each micro-batch's own
# statistics, as verl does; with an empty covariance window / a zero penalty coefficient the picked tokens do not
# change the loss, which leaves what these tests check: the global aggregation.
SETTINGS = {
    "dro": {"dro_beta": 0.3},
    "clip_cov": {"clip_cov_ratio": 0.5, "clip_cov_lb": 1e6, "clip_cov_ub": 2e6},
    "kl_cov": {"kl_cov_ratio": 0.5, "ppo_kl_coef": 0.0},
    # sequence IS weights and a sequence + a token rejection option: whole-sequence sums, and tokens rejected
    "bypass_mode": {
        "rollout_correction": RolloutCorrectionConfig(
            loss_type="reinforce",
            rollout_is="sequence",
            rollout_rs="seq_mean_k3,token_k1",
            rollout_rs_threshold="0.1,0.6_1.6",
        )
    },
}
SEQUENCE_LEVEL = ("gspo", "geo_mean")  # whole-sequence sums (row_sum)


def config(loss_mode: str, mode: str) -> ActorConfig:
    return ActorConfig(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **SETTINGS.get(loss_mode, {})),
        tau_pos=1.5,
        tau_neg=2.0,
    )


def random_batch(seed: int, b: int = 9, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.05
    old = lp + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    adv[1] = torch.randn(t, generator=g, dtype=torch.float64)  # a token-level row too
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    mask[2] = 0.0  # fully masked rows: GMPO still counts them (verl's torch.mean over rows)
    mask[6] = 0.0
    mask[4, 1:] = 0.0  # a one-token response
    weights = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5
    return lp, old, adv, mask, weights


def test_every_verl_loss_is_registered() -> None:
    assert set(VERL_LOSSES) <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", VERL_LOSSES)
def test_split_into_micro_batches_equals_whole(loss_mode: str, mode: str) -> None:
    """Micro-batches (or data-parallel ranks) with the whole batch's normalisers add up to the whole-batch loss, its
    gradient and its metric sums, for every registered loss and aggregation mode."""
    lp, old, adv, mask, weights = random_batch(seed=len(loss_mode) * 7 + len(mode))
    leaf = lp.clone().requires_grad_(True)
    cfg = config(loss_mode, mode)
    norm = LossNormalisers.of(mask, max_response_length=8)

    def loss_of(rows: slice, is_weights):
        return dapo_loss(
            leaf[rows],
            None,
            loss_mask=mask[rows],
            response_mask=mask[rows],
            advantages=adv[rows],
            cfg=cfg,
            norm=norm,
            old_log_probs=old[rows],
            rollout_log_probs=old[rows],
            rollout_is_weights=None if is_weights is None else is_weights[rows],
        )

    for is_weights in (None, weights):
        whole, sums_whole = loss_of(slice(0, 9), is_weights)
        parts = [loss_of(slice(a, b), is_weights) for a, b in ((0, 2), (2, 3), (3, 7), (7, 9))]
        split = sum(loss for loss, _ in parts)
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
        (grad_whole,) = torch.autograd.grad(whole, leaf)
        (grad_split,) = torch.autograd.grad(split, leaf)
        torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)
        assert grad_whole.abs().sum() > 0
        for key, value in sums_whole.items():
            torch.testing.assert_close(sum(s[key] for _, s in parts), value, rtol=1e-12, atol=1e-14)


def test_geo_mean_averages_over_every_row_like_verl() -> None:
    """GMPO's sequence losses are averaged over all rows, fully masked ones included (verl's ``torch.mean``), with
    the step's row count: a micro-batch of empty rows contributes 0 but still counts."""
    lp, old, adv, mask, _ = random_batch(seed=3)
    cfg = config("geo_mean", "token-mean")
    norm = LossNormalisers.of(mask)
    assert (norm.row_count, norm.seq_count) == (9, 7)
    loss, _ = dapo_loss(
        lp, None, loss_mask=mask, response_mask=mask, advantages=adv, cfg=cfg, norm=norm, old_log_probs=old
    )
    count = mask.sum(-1)
    log_ratio = lp - old
    sign = torch.sign(adv)
    clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-0.2, 0.28))
    rows = -((adv * mask).sum(-1) / (count + 1e-8)) * torch.exp((clipped * mask).sum(-1) / (count + 1e-8))
    torch.testing.assert_close(loss, rows.mean(), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- context parallelism


def cp_batch(seed: int) -> TrainBatch:
    """Rows of different prompt and response lengths, with a masked response token and a fully masked row."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens, p, t = [2, 1, 3, 2], [5, 2, 4, 1], 3, 5
    rows = len(prompt_lens)
    prompts, prompt_mask = torch.zeros(rows, p, dtype=torch.long), torch.zeros(rows, p, dtype=torch.long)
    responses, response_mask = torch.zeros(rows, t, dtype=torch.long), torch.zeros(rows, t, dtype=torch.long)
    for i, (n, m) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, p - n :] = torch.arange(1, n + 1)
        prompt_mask[i, p - n :] = 1
        responses[i, :m] = torch.arange(1, m + 1) + 100
        response_mask[i, :m] = 1
    batch = TrainBatch(prompts=prompts, prompt_mask=prompt_mask, responses=responses, response_mask=response_mask)
    batch.loss_mask = batch.response_mask.double()
    batch.loss_mask[0, 2] = 0.0
    batch.loss_mask[3] = 0.0
    batch.advantages = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, t).clone()
    batch.advantages[2] = torch.randn(t, generator=g, dtype=torch.float64)
    batch.old_log_probs = -torch.rand(rows, t, generator=g, dtype=torch.float64) * 2
    return batch


class FakeCPGroup:
    """Two context-parallel ranks run in two threads; ``all_reduce`` sums a tensor over both, in lockstep (as the
    actor's ``dist.all_reduce`` over the CP group does)."""

    def __init__(self, size: int = 2) -> None:
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        total = sum(self.slots)
        self.barrier.wait()  # every rank has read the slots before the next call overwrites them
        tensor.copy_(total)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_mode", [name for name in VERL_LOSSES if name not in ("clip_cov", "kl_cov")])
def test_context_parallel_ranks_add_up_to_the_whole_sequence(loss_mode: str, mode: str) -> None:
    """CP 2: each rank holds two chunks of every row (``context_parallel_slice``); its log-probs are read from the
    per-position model output (the slicing test's stand-in: a value per global position), and the sequence-level
    sums go through ``partial_row_sum`` with an all-reduce over the two ranks. The ranks' losses add up to the
    whole sequence's loss and their gradients (w.r.t. the per-position output) to its gradient."""
    cp = 2
    batch = cp_batch(seed=len(loss_mode))
    mb = make_micro_batch(batch, list(range(len(batch))), seq_multiple=2 * cp)
    b, seq_len = mb.tokens.shape
    g = torch.Generator().manual_seed(11)
    per_position = (-torch.rand(b, seq_len, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    cfg = config(loss_mode, mode)
    norm = LossNormalisers.of(mb.loss_mask)

    def loss_on(part, log_probs, row_sum):
        return dapo_loss(
            log_probs,
            None,
            loss_mask=part.loss_mask,
            response_mask=part.response_mask,
            advantages=part.advantages,
            cfg=cfg,
            norm=norm,
            old_log_probs=part.old_log_probs,
            rollout_log_probs=part.old_log_probs,
            row_sum=row_sum,
        )

    whole, whole_sums = loss_on(mb, per_position.gather(1, mb.response_index), None)
    (grad_whole,) = torch.autograd.grad(whole, per_position)

    group = FakeCPGroup(cp)
    results: dict[int, tuple] = {}

    def rank_step(rank: int) -> None:
        part = context_parallel_slice(mb, cp, rank)
        chunk = seq_len // (2 * cp)
        kept = list(range(rank * chunk, (rank + 1) * chunk))
        kept += list(range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
        local_out = per_position[:, kept]  # what this rank's forward produces
        row_sum = partial_row_sum(part.loss_mask, lambda t: group.all_reduce(rank, t))
        loss, sums = loss_on(part, local_out.gather(1, part.response_index), row_sum)
        (grad,) = torch.autograd.grad(loss, per_position)
        results[rank] = (loss.detach(), sums, grad)

    threads = [threading.Thread(target=rank_step, args=(rank,)) for rank in range(cp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1]
    torch.testing.assert_close(results[0][0] + results[1][0], whole.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[0][2] + results[1][2], grad_whole, rtol=1e-12, atol=1e-14)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "num_tokens"):
        if key in whole_sums:
            torch.testing.assert_close(results[0][1][key] + results[1][1][key], whole_sums[key])
    assert grad_whole.abs().sum() > 0


@pytest.mark.parametrize("loss_mode", SEQUENCE_LEVEL)
def test_sequence_level_losses_need_the_whole_sequence(loss_mode: str) -> None:
    """Without the CP row sum a rank would use its own part of each sequence: a different loss (so the test above
    exercises the all-reduce, not a coincidence)."""
    cp = 2
    mb = make_micro_batch(cp_batch(seed=1), [0, 1, 2, 3], seq_multiple=2 * cp)
    lp = -torch.rand(mb.tokens.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    cfg = config(loss_mode, "token-mean")
    norm = LossNormalisers.of(mb.loss_mask)
    whole, _ = dapo_loss(
        lp.gather(1, mb.response_index),
        None,
        loss_mask=mb.loss_mask,
        response_mask=mb.response_mask,
        advantages=mb.advantages,
        cfg=cfg,
        norm=norm,
        old_log_probs=mb.old_log_probs,
    )
    local_total = 0.0
    for rank in range(cp):
        part = context_parallel_slice(mb, cp, rank)
        local, _ = dapo_loss(
            lp.gather(1, mb.response_index),
            None,
            loss_mask=part.loss_mask,
            response_mask=part.response_mask,
            advantages=part.advantages,
            cfg=cfg,
            norm=norm,
            old_log_probs=part.old_log_probs,
        )
        local_total += float(local)
    assert abs(local_total - float(whole)) > 1e-6


def test_partial_row_sum_value_is_the_total_gradient_is_local() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    remote = torch.tensor([10.0, 20.0], dtype=torch.float64)
    row_sum = partial_row_sum(mask, lambda t: t.add_(remote))
    out = row_sum(values)
    torch.testing.assert_close(out, torch.tensor([14.0, 20.0], dtype=torch.float64))
    (grad,) = torch.autograd.grad(out.sum(), values)
    torch.testing.assert_close(grad, mask)


def test_default_row_sum_is_the_local_masked_sum() -> None:
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    inputs = PolicyLossInputs(x, x, x, mask, cfg=None)
    assert inputs.sum_rows(x).tolist() == [4.0]


def test_metrics_verl_does_not_report_read_zero() -> None:
    """gpg reports no metric in verl, dro and kl_cov only ppo_kl: ours read 0 for the missing ones."""
    lp, old, adv, mask, _ = random_batch(seed=4)
    for loss_mode, zero in (("gpg", ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")), ("dro", ("pg_clipfrac",))):
        _, sums = dapo_loss(
            lp,
            None,
            loss_mask=mask,
            response_mask=mask,
            advantages=adv,
            cfg=config(loss_mode, "token-mean"),
            norm=LossNormalisers.of(mask),
            old_log_probs=old,
        )
        metrics = loss_metrics({k: float(v) for k, v in sums.items()}, use_kl_loss=False)
        assert all(metrics[f"actor/{name}"] == 0.0 for name in zero)


# ----------------------------------------------------------------------------- config


def test_policy_loss_string_is_the_loss_mode() -> None:
    assert ActorConfig(policy_loss="gspo").policy_loss == PolicyLossConfig(loss_mode="gspo")
    assert ActorConfig().policy_loss.loss_mode == "vanilla"
    cfg = load_config(overrides=["actor.policy_loss=sapo", "actor.tau_pos=2.0"])
    assert cfg.actor.policy_loss.loss_mode == "sapo" and cfg.actor.tau_pos == 2.0
    cfg = load_config(overrides=["actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.01"])
    assert cfg.actor.policy_loss == PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.01)


def test_verl_defaults() -> None:
    pl = PolicyLossConfig()
    assert (pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub) == (0.0002, 1.0, 5.0)
    assert (pl.kl_cov_ratio, pl.ppo_kl_coef, pl.dro_beta) == (0.0002, 0.1, None)
    assert (ActorConfig().tau_pos, ActorConfig().tau_neg) == (1.0, 1.05)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor.policy_loss=dro"], "actor.policy_loss.dro_beta=None: expected a finite value > 0 with loss_mode=dro"),
        (["actor.policy_loss.dro_beta=-1"], "actor.policy_loss.dro_beta=-1.0: expected null or a finite value > 0"),
        (["actor.policy_loss.clip_cov_ratio=0"], "actor.policy_loss.clip_cov_ratio=0.0: expected a fraction in (0, 1]"),
        (["actor.policy_loss.kl_cov_ratio=2"], "actor.policy_loss.kl_cov_ratio=2.0: expected a fraction in (0, 1]"),
        (
            ["actor.policy_loss.clip_cov_lb=3", "actor.policy_loss.clip_cov_ub=2"],
            "actor.policy_loss.clip_cov_ub=2.0: expected a value > actor.policy_loss.clip_cov_lb=3.0",
        ),
        (["actor.policy_loss.ppo_kl_coef=-0.1"], "actor.policy_loss.ppo_kl_coef=-0.1: expected a finite value >= 0"),
        (["actor.tau_neg=0"], "actor.tau_neg=0.0: expected a finite value > 0"),
    ],
)
def test_bad_policy_loss_values_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        raise_if_any(config_problems(load_config(overrides=overrides)))
    assert expected in str(error.value)


def test_good_policy_loss_settings_have_no_problem() -> None:
    cfg = load_config(overrides=["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"])
    assert cfg.actor.policy_loss.dro_beta == 0.1
    assert not [p for p in config_problems(cfg) if "policy_loss" in p or "tau_" in p]


# ----------------------------------------------------------------------------- bypass_mode (rollout correction)

#: Every IS level and threshold form and every rejection option (alone, chained), for the split test below.
BYPASS_SETTINGS = [
    {"loss_type": "ppo_clip", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6"},
    {"loss_type": "ppo_clip", "rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "0.08,0.1"},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 2.0},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 0.3},
    {"loss_type": "reinforce", "rollout_is_threshold": "0.5_1.5", "rollout_is": "token", "rollout_rs": "seq_sum_k3",
     "rollout_rs_threshold": 0.3},
    {"loss_type": "reinforce", "rollout_is_threshold": "0.2_3", "rollout_is": "sequence", "rollout_rs": "seq_mean_k1",
     "rollout_rs_threshold": "0.8_1.2"},
    {"loss_type": "ppo_clip", "rollout_rs": "seq_mean_k2, seq_max_k2", "rollout_rs_threshold": "0.06,0.3"},
    {"loss_type": "reinforce", "rollout_rs": "seq_mean_k3,seq_max_k3", "rollout_rs_threshold": 0.15},
]  # fmt: skip


def bypass_config(mode: str, **rc) -> ActorConfig:
    cfg = config("bypass_mode", mode)
    cfg.policy_loss.rollout_correction = RolloutCorrectionConfig(**rc)
    return cfg


def bypass_loss(cfg: ActorConfig, lp, rollout, adv, mask, norm, rows=slice(None), old=None):
    return dapo_loss(
        lp[rows],
        None,
        loss_mask=mask[rows],
        response_mask=mask[rows],
        advantages=adv[rows],
        cfg=cfg,
        norm=norm,
        old_log_probs=(rollout if old is None else old)[rows],  # the proximal log-probs, ignored by bypass_mode
        rollout_log_probs=rollout[rows],
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("setting", range(len(BYPASS_SETTINGS)))
def test_bypass_mode_every_correction_is_exact_under_a_split(setting: int, mode: str) -> None:
    """Rejection sampling decides per token or per whole sequence and the IS weights are per token or per whole
    sequence, so with the global normalisers the micro-batches still add up to the whole batch (loss, gradient,
    metric sums); each setting rejects some tokens but not all."""
    lp, rollout, adv, mask, _ = random_batch(seed=setting)
    cfg = bypass_config(mode, **BYPASS_SETTINGS[setting])
    norm = LossNormalisers.of(mask, max_response_length=8)
    leaf = lp.clone().requires_grad_(True)
    whole, sums_whole = bypass_loss(cfg, leaf, rollout, adv, mask, norm)
    parts = [bypass_loss(cfg, leaf, rollout, adv, mask, norm, slice(a, b)) for a, b in ((0, 2), (2, 5), (5, 9))]
    split = sum(loss for loss, _ in parts)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
    (grad_whole,) = torch.autograd.grad(whole, leaf)
    (grad_split,) = torch.autograd.grad(split, leaf)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)
    for key, value in sums_whole.items():
        torch.testing.assert_close(sum(s[key] for _, s in parts), value, rtol=1e-12, atol=1e-14)
    assert 0 < float(sums_whole["num_tokens"]) < float(mask.sum())  # kept tokens: some rejected, not all


def test_bypass_mode_rejected_tokens_keep_counting_in_the_normaliser() -> None:
    """token-mean: the kept tokens' losses over *every* loss token (verl's ``batch_num_tokens``, counted before the
    loss); rejected tokens get no gradient; the old policy is the rollout's (the proximal log-probs are ignored)."""
    lp, rollout, adv, mask, _ = random_batch(seed=21)
    cfg = bypass_config("token-mean", loss_type="reinforce", rollout_rs="token_k2", rollout_rs_threshold=0.08)
    leaf = lp.clone().requires_grad_(True)
    loss, sums = bypass_loss(cfg, leaf, rollout, adv, mask, LossNormalisers.of(mask), old=lp + 1.0)
    keep = (0.5 * (lp - rollout) ** 2 <= 0.08) & mask.bool()
    assert 0 < keep.sum() < mask.sum()
    expected = (-adv * lp)[keep].sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(loss, leaf)
    assert (grad[~keep] == 0).all() and (grad[keep] != 0).any()
    assert float(sums["num_tokens"]) == float(keep.sum())  # the metric means are over the kept tokens, as verl's
    with pytest.raises(ValueError, match="rollout log-probs"):
        dapo_loss(lp, None, loss_mask=mask, response_mask=mask, advantages=adv, cfg=cfg, norm=LossNormalisers.of(mask))


def test_bypass_mode_batch_normalisation_is_per_micro_batch() -> None:
    """``rollout_is_batch_normalize`` divides by the weights' mean over the rows the loss sees, as verl's
    single-process path: the one setting whose value depends on the micro-batch split."""
    lp, rollout, adv, mask, _ = random_batch(seed=5)
    from megatron_dapo.algo.rollout_correction import rollout_is_weights

    def sums(m):
        return lambda x: (x * m).sum(-1)

    for rows in (slice(None), slice(0, 4)):
        m = mask[rows]
        w = rollout_is_weights(lp[rows] - rollout[rows], m, sums(m), "token", 1.5, batch_normalize=True)
        torch.testing.assert_close((w * m).sum() / m.sum(), torch.tensor(1.0, dtype=w.dtype))
        w = rollout_is_weights(lp[rows] - rollout[rows], m, sums(m), "sequence", 1.5, batch_normalize=True)
        seq = w.max(-1).values[m.sum(-1) > 0]
        torch.testing.assert_close(seq.mean(), torch.tensor(1.0, dtype=w.dtype), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor.policy_loss.rollout_correction.loss_type=pg"], "rollout_correction.loss_type='pg': expected ppo_clip"),
        (["actor.policy_loss.rollout_correction.rollout_is=seq"], "rollout_correction.rollout_is='seq': expected null"),
        (["actor.policy_loss.rollout_correction.rollout_is_threshold=0"], "rollout_is_threshold=0.0: expected a num"),
        (["actor.policy_loss.rollout_correction.rollout_is_threshold='2_1'"], "lower bound 2.0 must be <= upper"),
        (["actor.policy_loss.rollout_correction.rollout_rs=token_k4"], "rollout_rs='token_k4': expected null or"),
        (["actor.policy_loss.rollout_correction.rollout_rs=token_k2"], "rollout_rs_threshold=None: expected thresh"),
        (
            ["actor.policy_loss.rollout_correction.rollout_rs='token_k2,seq_sum_k1'",
             "actor.policy_loss.rollout_correction.rollout_rs_threshold='1,2,3'"],
            "exactly 2 (one per rollout_rs option)",
        ),
        (
            ["actor.policy_loss.rollout_correction.rollout_rs=seq_max_k3",
             "actor.policy_loss.rollout_correction.rollout_rs_threshold='0.5_2'"],
            "seq_max_k3 takes a single upper bound",
        ),
    ],
)  # fmt: skip
def test_bad_rollout_correction_values_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        raise_if_any(config_problems(load_config(overrides=["actor.policy_loss.loss_mode=bypass_mode", *overrides])))
    assert expected in str(error.value)


def test_good_rollout_correction_settings_have_no_problem() -> None:
    rc = "actor.policy_loss.rollout_correction"
    cfg = load_config(
        overrides=[
            "actor.policy_loss.loss_mode=bypass_mode",
            f"{rc}.loss_type=reinforce",
            f"{rc}.rollout_is=sequence",
            f"{rc}.rollout_is_threshold='0.5_5.0'",
            f"{rc}.rollout_rs='token_k1,seq_max_k3'",
            f"{rc}.rollout_rs_threshold='0.5_2.0,0.1'",
        ]
    )
    assert cfg.actor.policy_loss.rollout_correction.rollout_is_threshold == "0.5_5.0"
    assert not [p for p in config_problems(cfg) if "policy_loss" in p]
    assert RolloutCorrectionConfig() == RolloutCorrectionConfig(
        loss_type="ppo_clip", rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None
    )  # verl's YAML defaults


def test_bypass_mode_refuses_the_correction_it_would_ignore():
    with pytest.raises(ConfigError, match="bypass_mode with algorithm.rollout_is_threshold=2.0"):
        bypass = ["actor.policy_loss.loss_mode=bypass_mode", "algorithm.rollout_is_threshold=2.0"]
        raise_if_any(config_problems(load_config(overrides=bypass)))
    assert load_config(overrides=["actor.policy_loss.loss_mode=bypass_mode"]).algorithm.rollout_is_threshold is None
