"""Advantage estimators against plain float64 loop references and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo.advantages import (
    compute_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    group_index,
)
from megatron_dapo.algo.masked import masked_mean, masked_var, masked_whiten

# ----------------------------------------------------------------------------- plain references (float64 loops)


def _groups(ids: list) -> dict:
    out: dict = {}
    for i, g in enumerate(ids):
        out.setdefault(g, []).append(i)
    return out


def ref_grpo(scores: list[float], ids: list, mask: list[list[float]], norm: bool = True, eps: float = 1e-6):
    adv = [0.0] * len(scores)
    for rows in _groups(ids).values():
        vals = [scores[i] for i in rows]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in rows:
            adv[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


def ref_rloo(scores, ids, mask):
    adv = list(scores)
    for rows in _groups(ids).values():
        n = len(rows)
        if n > 1:
            for i in rows:
                others = [scores[j] for j in rows if j != i]
                adv[i] = scores[i] - sum(others) / (n - 1)
    return [[adv[i] * m for m in mask[i]] for i in range(len(scores))]


def ref_whiten(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    sel = [v for row, mrow in zip(values, mask, strict=True) for v, m in zip(row, mrow, strict=True) if m]
    n = len(sel)
    mean = sum(sel) / (n + 1e-8)  # verl's masked_mean adds 1e-8 to the count
    var = sum((v - mean) ** 2 for v in sel) / (n + 1e-8) * n / (n - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def ref_reinforce_pp(rewards, mask, gamma):
    returns = []
    for r_row, m_row in zip(rewards, mask, strict=True):
        out = [0.0] * len(r_row)
        running = 0.0
        for t in reversed(range(len(r_row))):
            if m_row[t]:  # verl 0.9.1: masked-out tokens get return 0 and pass the running return through
                running = r_row[t] + gamma * running
                out[t] = running
        returns.append(out)
    adv = ref_whiten(returns, mask)
    return [[a * m for a, m in zip(ar, mr, strict=True)] for ar, mr in zip(adv, mask, strict=True)], returns


def ref_rpp_baseline(scores, ids, mask):
    centred = list(scores)
    for rows in _groups(ids).values():
        mean = 0.0 if len(rows) == 1 else sum(scores[i] for i in rows) / len(rows)
        for i in rows:
            centred[i] = scores[i] - mean
    mat = [[centred[i] * m for m in mask[i]] for i in range(len(scores))]
    w = ref_whiten(mat, mask)
    return [[a * m for a, m in zip(ar, mr, strict=True)] for ar, mr in zip(w, mask, strict=True)]


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ----------------------------------------------------------------------------- strategies


@st.composite
def grouped_batch(draw, min_tokens: int = 0):
    b = draw(st.integers(1, 10))
    t = draw(st.integers(max(1, min_tokens), 6))
    ids = draw(st.lists(st.sampled_from(["p0", "p1", "p2", 7, 8]), min_size=b, max_size=b))
    score_values = st.one_of(st.sampled_from([-1.0, 0.0, 1.0]), st.floats(-5, 5, allow_nan=False, width=32))
    scores = draw(st.lists(score_values, min_size=b, max_size=b))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))  # 0 = fully masked row
    mask = [[1.0 if j < n else 0.0 for j in range(t)] for n in lengths]
    if sum(lengths) < min_tokens:  # whitening needs >= 2 selected tokens (t >= min_tokens here)
        mask[0] = [1.0] * t
    return scores, ids, mask


# ----------------------------------------------------------------------------- GRPO


def test_grpo_hand_computed() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0])
    ids = ["a", "a", "b", "b", "c"]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]])
    adv, ret = compute_grpo_advantages(scores, ids, mask)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # group a: mean 0.5, unbiased std sqrt(0.5)
    expected = torch.tensor(
        [[s, s, 0], [-s, 0, 0], [0, 0, 0], [0, 0, 0], [5 / (1 + 1e-6), 5 / (1 + 1e-6), 0]], dtype=torch.float32
    )
    torch.testing.assert_close(adv, expected)
    assert adv is ret or torch.equal(adv, ret)
    assert adv.dtype == torch.float32 and adv.shape == (5, 3)


def test_grpo_without_std_normalisation() -> None:
    adv, _ = compute_grpo_advantages(t64([3.0, 1.0, 4.0]), [0, 0, 1], torch.ones(3, 2), norm_by_std=False)
    torch.testing.assert_close(adv, t64([[1.0, 1.0], [-1.0, -1.0], [4.0, 4.0]]))


@given(grouped_batch(), st.booleans())
@settings(max_examples=60, deadline=None)
def test_grpo_matches_reference(batch, norm) -> None:
    scores, ids, mask = batch
    adv, _ = compute_grpo_advantages(t64(scores), ids, t64(mask), norm_by_std=norm)
    torch.testing.assert_close(adv, t64(ref_grpo(scores, ids, mask, norm)), rtol=1e-9, atol=1e-6)


def test_grpo_zero_variance_group_and_group_of_one() -> None:
    adv, _ = compute_grpo_advantages(t64([1.0, 1.0, 1.0, -1.0]), ["x", "x", "x", "y"], torch.ones(4, 2))
    assert torch.all(adv[:3] == 0)
    torch.testing.assert_close(adv[3], t64([-1 / (1 + 1e-6)] * 2))


def test_group_ids_forms_agree() -> None:
    scores = torch.tensor([0.2, 0.9, -1.0, 0.5, 0.5, 3.0])
    mask = torch.ones(6, 2)
    as_list, _ = compute_grpo_advantages(scores, [5, 5, 2, 2, 2, 9], mask)
    as_tensor, _ = compute_grpo_advantages(scores, torch.tensor([5, 5, 2, 2, 2, 9]), mask)
    as_str, _ = compute_grpo_advantages(scores, np.array(["u", "u", "v", "v", "v", "w"], dtype=object), mask)
    torch.testing.assert_close(as_list, as_tensor)
    torch.testing.assert_close(as_list, as_str)


def test_group_index_first_appearance_order() -> None:
    index, n = group_index(["b", "a", "b", "c"])
    assert n == 3 and index.tolist() == [0, 1, 0, 2]


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_grpo_advantages(torch.zeros(3), [0, 1], torch.ones(3, 2))
    with pytest.raises(ValueError, match="response_mask must be"):
        compute_grpo_advantages(torch.zeros(3), [0, 1, 2], torch.ones(2, 2))


# ----------------------------------------------------------------------------- RLOO


def test_rloo_hand_computed() -> None:
    adv, _ = compute_rloo_advantages(t64([1.0, 0.0, 0.0, 2.0]), ["a", "a", "a", "b"], torch.ones(4, 1))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; group of one keeps its score
    torch.testing.assert_close(adv[:, 0], t64([1.0, -0.5, -0.5, 2.0]))


@given(grouped_batch())
@settings(max_examples=50, deadline=None)
def test_rloo_matches_reference(batch) -> None:
    scores, ids, mask = batch
    adv, _ = compute_rloo_advantages(t64(scores), ids, t64(mask))
    torch.testing.assert_close(adv, t64(ref_rloo(scores, ids, mask)), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- REINFORCE++ (+ baseline)


def test_reinforce_pp_returns_hand_computed() -> None:
    rewards = t64([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = t64([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, returns = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, t64([[0.25, 0.5, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    assert torch.all(adv[mask == 0] == 0)
    sel = adv[mask.bool()]
    assert abs(sel.mean().item()) < 1e-7  # zero mean up to verl's 1e-8 in the masked-mean denominator


def test_reinforce_pp_carries_returns_across_masked_spans() -> None:
    # The masked-out token in the middle (an observation span) gets return 0; the reward behind it still reaches t=0.
    rewards = t64([[0.0, 7.0, 0.0, 1.0]])
    mask = t64([[1, 0, 1, 1]])
    _, returns = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, t64([[0.25, 0.0, 0.5, 1.0]]))


@given(grouped_batch(min_tokens=2), st.sampled_from([1.0, 0.9, 0.5]), st.integers(0, 2**31 - 1))
@settings(max_examples=50, deadline=None)
def test_reinforce_pp_matches_reference(batch, gamma, seed) -> None:
    _, _, mask = batch
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(mask), len(mask[0]), generator=g, dtype=torch.float64)
    rewards[torch.rand(rewards.shape, generator=g) < 0.3] = 0.0
    adv, returns = compute_reinforce_pp_advantages(rewards, t64(mask), gamma)
    ref_adv, ref_ret = ref_reinforce_pp(rewards.tolist(), mask, gamma)
    torch.testing.assert_close(returns, t64(ref_ret), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, t64(ref_adv), rtol=1e-9, atol=1e-9)


def test_reinforce_pp_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least two"):
        compute_reinforce_pp_advantages(torch.ones(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]))


@given(grouped_batch(min_tokens=2))
@settings(max_examples=50, deadline=None)
def test_reinforce_pp_baseline_matches_reference(batch) -> None:
    scores, ids, mask = batch
    adv, _ = compute_reinforce_pp_baseline_advantages(t64(scores), ids, t64(mask))
    torch.testing.assert_close(adv, t64(ref_rpp_baseline(scores, ids, mask)), rtol=1e-8, atol=1e-7)


def test_dispatch() -> None:
    scores, ids, mask = t64([1.0, 0.0]), ["a", "a"], torch.ones(2, 2)
    grpo = compute_advantages("grpo", scores=scores, group_ids=ids, response_mask=mask)[0]
    torch.testing.assert_close(grpo, compute_grpo_advantages(scores, ids, mask)[0])
    rewards = torch.zeros(2, 2, dtype=torch.float64)
    rewards[:, -1] = scores
    rpp = compute_advantages(
        "reinforce_plus_plus", scores=scores, group_ids=ids, response_mask=mask, token_level_rewards=rewards
    )[0]
    torch.testing.assert_close(rpp, compute_reinforce_pp_advantages(rewards, mask)[0])
    with pytest.raises(ValueError, match="needs token_level_rewards"):
        compute_advantages("reinforce_plus_plus", scores=scores, group_ids=ids, response_mask=mask)
    with pytest.raises(ValueError, match="algorithm.adv_estimator=.gae.: no such advantage estimator"):
        compute_advantages("gae", scores=scores, group_ids=ids, response_mask=mask)


# ----------------------------------------------------------------------------- masked helpers


def test_masked_helpers_ignore_nan_padding() -> None:
    values = t64([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]])
    mask = t64([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(values, mask, axis=-1), t64([1.5, 3.0]))
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # unbiased var of 1, 2, 3
    w = masked_whiten(values, mask)
    torch.testing.assert_close(w[mask.bool()], t64([-1.0, 0.0, 1.0]) / math.sqrt(1 + 1e-8))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="one element"):
        masked_var(values, t64([[1, 0, 0], [0, 0, 0]]))
