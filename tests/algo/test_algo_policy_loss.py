"""PPO policy loss (clip-higher, dual clip), aggregation modes and the distributed split form."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo.loss import LossNormalisers, dapo_loss, local_loss_counts, loss_metrics
from megatron_dapo.algo.loss_aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss_terms,
    compute_rollout_is_weights,
    policy_loss_metric_sums,
)
from megatron_dapo.config import ActorConfig

LOW, HIGH, C = 0.2, 0.28, 3.0

# ----------------------------------------------------------------------------- plain references


def whole_batch_loss(lp, old, adv, mask, mode, is_weights=None):
    """The one loss function (``dapo_loss``) on a whole batch, with verl's policy-loss metric names."""
    cfg = ActorConfig(clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, loss_agg_mode=mode)
    loss, sums = dapo_loss(
        lp,
        None,
        loss_mask=mask,
        response_mask=mask,
        advantages=adv,
        old_log_probs=old,
        rollout_is_weights=is_weights,
        cfg=cfg,
        norm=LossNormalisers.of(mask),
    )
    metrics = {k.split("/")[1]: v for k, v in loss_metrics(sums, use_kl_loss=False).items() if k != "actor/entropy"}
    return loss, metrics


def ref_token_loss(lp: float, old: float, adv: float, low=LOW, high=HIGH, c=C) -> tuple[float, float, float, float]:
    """(loss, clipped, clipped_lower, approx_kl) of one token, written out case by case."""
    log_ratio = min(max(lp - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    lower = 0.0
    if adv < 0:
        if loss > -adv * c:
            lower = 1.0
        loss = min(loss, -adv * c)
    return loss, float(clipped > unclipped), lower, -log_ratio


def ref_agg(mat: list[list[float]], mask: list[list[float]], mode: str, scale: float | None = None) -> float:
    if mode == "token-mean":
        n = sum(sum(r) for r in mask)
        return sum(v * m for vr, mr in zip(mat, mask, strict=True) for v, m in zip(vr, mr, strict=True)) / n
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        per_seq = []
        for vr, mr in zip(mat, mask, strict=True):
            cnt = sum(mr)
            if cnt == 0:
                continue
            s = sum(v * m for v, m in zip(vr, mr, strict=True))
            per_seq.append(s if mode == "seq-mean-token-sum" else s / (cnt + 1e-8))
        return sum(per_seq) / len(per_seq)
    # seq-mean-token-sum-norm (verl 0.9.1): token sum / non-empty sequences / loss_scale_factor
    total = sum(v * m for vr, mr in zip(mat, mask, strict=True) for v, m in zip(vr, mr, strict=True))
    n_seqs = sum(1 for mr in mask if sum(mr) > 0)
    return total / n_seqs / (scale if scale is not None else len(mask[0]))


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ----------------------------------------------------------------------------- hand-computed


def test_terms_hand_computed() -> None:
    # tokens: A>0 ratio 1.5 (clipped at 1.28); A<0 ratio 0.5 (clipped at 0.8); A<0 ratio 5 (dual clip at c=3);
    # A>0 ratio 0.5 (unclipped: the min of the objective keeps the ratio); A<0, ratio 1 (nothing clipped)
    ratios = [1.5, 0.5, 5.0, 0.5, 1.0]
    adv = t64([[1.0, -1.0, -1.0, 2.0, -0.5]])
    old = torch.zeros(1, 5, dtype=torch.float64)
    lp = t64([[math.log(r) for r in ratios]])
    terms = compute_policy_loss_terms(lp, old, adv, LOW, HIGH, C)
    torch.testing.assert_close(terms["pg_losses"], t64([[-1.28, 0.8, 3.0, -1.0, 0.5]]))
    torch.testing.assert_close(terms["clipped"], t64([[1.0, 1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(terms["clipped_lower"], t64([[0.0, 0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(terms["approx_kl"], -lp)


def test_log_ratio_clamp_at_20() -> None:
    lp, old = t64([[50.0, -50.0]]), t64([[0.0, 0.0]])
    terms = compute_policy_loss_terms(lp, old, t64([[-1.0, 1.0]]), LOW, HIGH, 10.0)
    torch.testing.assert_close(terms["ratio"], t64([[math.exp(20.0), math.exp(-20.0)]]))
    torch.testing.assert_close(terms["approx_kl"], t64([[-20.0, 20.0]]))
    # A<0 with ratio e^20: the dual clip caps the loss at -A*c = 10; A>0 with ratio e^-20: min objective keeps ratio
    torch.testing.assert_close(terms["pg_losses"], t64([[10.0, -math.exp(-20.0)]]))
    assert torch.isfinite(terms["pg_losses"]).all()


def test_compute_policy_loss_metrics_hand_computed() -> None:
    lp = t64([[math.log(1.5), math.log(5.0), 0.3], [0.0, 0.0, 0.0]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = t64([[1.0, -1.0, 7.0], [0.5, 0.5, 0.5]])
    mask = t64([[1, 1, 0], [1, 0, 0]])
    loss, metrics = whole_batch_loss(lp, old, adv, mask, "token-mean")
    # token losses: -1.28, 3.0, (masked), -0.5
    assert loss.item() == pytest.approx((-1.28 + 3.0 - 0.5) / 3)
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 3, rel=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 3, rel=1e-6)
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(5.0)) / 3, rel=1e-6)
    assert all(not v.requires_grad for v in metrics.values())


def test_agg_modes_hand_computed() -> None:
    mat = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t64([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert agg_loss(mat, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert agg_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert agg_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    # 18 over 2 non-empty sequences, over T = 3 (or the given max_response_length)
    assert agg_loss(mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(18 / 2 / 3)
    assert agg_loss(mat, mask, "seq-mean-token-sum-norm", max_response_length=6).item() == pytest.approx(1.5)
    assert agg_loss(mat, mask, "seq-mean-token-sum-norm", global_seq_count=4).item() == pytest.approx(18 / 4 / 3)
    assert agg_loss(mat, mask, "token-mean", global_token_count=10).item() == pytest.approx(1.8)
    assert agg_loss(mat, mask, "seq-mean-token-sum", global_seq_count=4).item() == pytest.approx(4.5)


def test_fully_masked_batch_gives_zero_and_nan_padding_is_ignored() -> None:
    mat = t64([[float("nan"), float("inf")], [1.0, float("nan")]])
    for mode in LOSS_AGG_MODES:
        assert agg_loss(mat, torch.zeros(2, 2), mode).item() == 0.0
        value = agg_loss(mat, t64([[0, 0], [1, 0]]), mode)
        assert torch.isfinite(value)


def test_invalid_arguments() -> None:
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="invalid loss_agg_mode 'mean'"):
        agg_loss(x, x, "mean")
    with pytest.raises(ValueError, match="differ in shape"):
        agg_loss(x, torch.zeros(2, 3), "token-mean")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_terms(x, x, x, LOW, HIGH, 1.0)


# ----------------------------------------------------------------------------- reference comparison


@st.composite
def loss_batch(draw):
    b = draw(st.integers(1, 8))
    t = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lengths], dtype=torch.float64)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(b, t, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.01, 0.3, 2.0, 40.0]))
    adv = torch.randn(b, t, generator=g, dtype=torch.float64) * 2
    return lp, old, adv, mask


@given(loss_batch(), st.sampled_from(LOSS_AGG_MODES))
@settings(max_examples=80, deadline=None)
def test_policy_loss_matches_reference(batch, mode) -> None:
    lp, old, adv, mask = batch
    rows = [
        [ref_token_loss(a, b, c) for a, b, c in zip(r1, r2, r3, strict=True)]
        for r1, r2, r3 in zip(lp.tolist(), old.tolist(), adv.tolist(), strict=True)
    ]
    losses = [[x[0] for x in r] for r in rows]
    m = mask.tolist()
    loss, metrics = whole_batch_loss(lp, old, adv, mask, mode)
    n_tok = sum(sum(r) for r in m)
    if n_tok == 0:
        assert loss.item() == 0.0
        return
    assert loss.item() == pytest.approx(ref_agg(losses, m, mode), rel=1e-9, abs=1e-12)
    for k, name in ((1, "pg_clipfrac"), (2, "pg_clipfrac_lower"), (3, "ppo_kl")):
        expected = sum(x[k] * mm for r, mr in zip(rows, m, strict=True) for x, mm in zip(r, mr, strict=True))
        assert metrics[name].item() == pytest.approx(expected / (n_tok + 1e-8), rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- split-form exactness


@st.composite
def split_case(draw):
    lp, old, adv, mask = draw(loss_batch())
    b = mask.shape[0]
    cuts = sorted(draw(st.lists(st.integers(1, max(1, b - 1)), max_size=4, unique=True))) if b > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < b], b]
    # every part may be padded to its own width (as with dynamic batching): trim trailing all-zero columns
    trims = draw(st.lists(st.booleans(), min_size=len(bounds) - 1, max_size=len(bounds) - 1))
    return lp, old, adv, mask, bounds, trims


@given(split_case(), st.sampled_from(LOSS_AGG_MODES))
@settings(max_examples=120, deadline=None)
def test_split_sum_equals_whole_batch(case, mode) -> None:
    lp, old, adv, mask, bounds, trims = case
    t = mask.shape[1]
    whole_terms = compute_policy_loss_terms(lp, old, adv, LOW, HIGH, C)
    whole = agg_loss(whole_terms["pg_losses"], mask, mode, max_response_length=t)

    parts = list(zip(bounds[:-1], bounds[1:], trims, strict=True))
    counts = sum(local_loss_counts(mask[a:b]) for a, b, _ in parts)  # what each rank/micro-batch contributes
    global_tokens, global_seqs = counts[0], counts[1]
    total = torch.zeros((), dtype=torch.float64)
    metric_sums: dict[str, torch.Tensor] = {}
    for a, b, trim in parts:
        width = t
        if trim:
            used = mask[a:b].sum(dim=0).nonzero()
            width = int(used.max().item()) + 1 if used.numel() else 1
        sl = (slice(a, b), slice(0, width))
        terms = compute_policy_loss_terms(lp[sl], old[sl], adv[sl], LOW, HIGH, C)
        total = total + agg_loss(
            terms["pg_losses"],
            mask[sl],
            mode,
            global_token_count=global_tokens,
            global_seq_count=global_seqs,
            max_response_length=t,
        )
        for k, v in policy_loss_metric_sums(terms, mask[sl]).items():
            metric_sums[k] = metric_sums.get(k, 0) + v
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    _, metrics = whole_batch_loss(lp, old, adv, mask, mode)
    for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        split_metric = metric_sums[name] / (metric_sums["num_tokens"] + 1e-8)
        torch.testing.assert_close(split_metric, metrics[name], rtol=1e-12, atol=1e-12)


def test_split_gradients_equal_whole_batch() -> None:
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(6, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[2] = 0
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(compute_policy_loss_terms(lp, old, adv, LOW, HIGH, C)["pg_losses"], mask, mode)
        (grad_whole,) = torch.autograd.grad(whole, lp)
        n = LossNormalisers.of(mask)
        split = sum(
            agg_loss(
                compute_policy_loss_terms(lp[a:b], old[a:b], adv[a:b], LOW, HIGH, C)["pg_losses"],
                mask[a:b],
                mode,
                global_token_count=n.token_count,
                global_seq_count=n.seq_count,
                max_response_length=5,
            )
            for a, b in ((0, 1), (1, 4), (4, 6))
        )
        (grad_split,) = torch.autograd.grad(split, lp)
        torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- truncated IS weights


def test_rollout_is_weights() -> None:
    old = t64([[0.0, -1.0, -3.0, 50.0]])
    rollout = t64([[0.0, -2.0, -1.0, 0.0]])
    mask = t64([[1, 1, 1, 0]])
    w = compute_rollout_is_weights(old, rollout, mask, threshold=2.0)
    torch.testing.assert_close(w, t64([[1.0, 2.0, math.exp(-2.0), 0.0]]))  # e^1 truncated to 2; masked -> 0
    assert not w.requires_grad
    with pytest.raises(ValueError, match="positive"):
        compute_rollout_is_weights(old, rollout, mask, threshold=0.0)


def test_is_weights_multiply_the_token_loss() -> None:
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    w = torch.rand(3, 4, generator=g, dtype=torch.float64)
    plain = compute_policy_loss_terms(lp, old, adv, LOW, HIGH, C)["pg_losses"]
    loss, _ = whole_batch_loss(lp, old, adv, mask, "token-mean", is_weights=w)
    assert loss.item() == pytest.approx((plain * w).mean().item(), rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_dapo_loss_split_into_micro_batches_equals_whole(mode: str) -> None:
    """The loss hook's use: micro-batches with the whole batch's normalisers add up to the whole-batch loss, entropy
    and KL terms included, and so do the gradients and the metric sums."""
    g = torch.Generator().manual_seed(2)
    lp = (-torch.rand(9, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    ent = torch.rand(9, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    old = lp.detach() + 0.5 * torch.randn(9, 4, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.2 * torch.randn(9, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(9, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(9, 4, generator=g) > 0.4).double()
    w = torch.rand(9, 4, generator=g, dtype=torch.float64)
    cfg = ActorConfig(
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
    )
    norm = LossNormalisers.of(mask, max_response_length=6)

    def loss_of(rows: slice):
        return dapo_loss(
            lp[rows],
            ent[rows],
            loss_mask=mask[rows],
            response_mask=mask[rows],
            advantages=adv[rows],
            cfg=cfg,
            norm=norm,
            old_log_probs=old[rows],
            ref_log_probs=ref[rows],
            rollout_is_weights=w[rows],
        )

    whole, sums_whole = loss_of(slice(0, 9))
    parts = [loss_of(slice(a, b)) for a, b in ((0, 2), (2, 7), (7, 9))]
    split = sum(loss for loss, _ in parts)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
    for key in ("pg_loss", "entropy", "kl_loss", "pg_clipfrac", "ppo_kl", "num_tokens"):
        torch.testing.assert_close(sum(s[key] for _, s in parts), sums_whole[key], rtol=1e-12, atol=1e-14)
    g_whole = torch.autograd.grad(whole, (lp, ent))
    g_split = torch.autograd.grad(split, (lp, ent))
    for a, b in zip(g_split, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # by hand: the entropy and KL terms are agg(entropy) and agg(KL) with the same normalisers
    manual = agg_loss(ent, mask, mode, norm.token_count, norm.seq_count, 6)
    torch.testing.assert_close(sums_whole["entropy"], manual.detach(), rtol=1e-12, atol=1e-14)
