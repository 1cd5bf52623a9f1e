"""DAPO group filtering and the dynamic-sampling accumulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingAccumulator, filter_groups


def ref_keep(values: list[float], ids: list) -> list[bool]:
    """verl's rule, written as in the DAPO trainer: np.std(values of the group) > 0 or a group of one."""
    groups: dict = {}
    for v, g in zip(values, ids, strict=True):
        groups.setdefault(g, []).append(v)
    kept = {g for g, vals in groups.items() if np.std(vals) > 0 or len(vals) == 1}
    return [g in kept for g in ids]


def test_filter_groups_hand_computed() -> None:
    ids = ["mixed", "mixed", "same", "same", "same", "alone", 3, 3]
    acc = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    keep = filter_groups(torch.tensor(acc), ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, False, False, False, True, False, False]


def test_filter_groups_bool_metric_nan_and_empty() -> None:
    assert filter_groups([True, False, True, True], [0, 0, 1, 1]).tolist() == [True, True, False, False]
    nan = float("nan")
    assert filter_groups([nan, 1.0, nan], ["a", "a", "b"]).tolist() == [False, False, True]
    assert filter_groups([], []).tolist() == []
    with pytest.raises(ValueError, match="metric_values has 2 entries"):
        filter_groups([1.0, 2.0], [0])


def test_constant_group_of_inexact_floats_is_dropped() -> None:
    # np.std([0.1] * 3) is 1.4e-17 > 0 (rounding); the group is constant and we drop it (documented deviation)
    assert np.std([0.1] * 3) > 0
    assert filter_groups([0.1, 0.1, 0.1], [0, 0, 0]).tolist() == [False, False, False]


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", 1, 2]), st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0])), max_size=24
    )
)
@settings(max_examples=100, deadline=None)
def test_filter_groups_matches_verl_rule(rows) -> None:
    ids = [r[0] for r in rows]
    values = [r[1] for r in rows]
    assert filter_groups(values, ids).tolist() == ref_keep(values, ids)


# ----------------------------------------------------------------------------- accumulator


def _gen_batch(prompt_ids: list[int], n: int, accs: list[list[float]], tag: str):
    """A generation batch of len(prompt_ids) prompts x n responses, interleaved as verl's repeat()."""
    ids = [p for p in prompt_ids for _ in range(n)]
    metric = [a for row in accs for a in row]
    rows = len(ids)
    batch = {
        "responses": torch.arange(rows * 3).reshape(rows, 3) + 1000 * len(tag),
        "tag": [f"{tag}{i}" for i in range(rows)],
        "uid_np": np.array(ids),
    }
    return batch, ids, metric


def test_accumulator_fills_in_arrival_order_and_trims() -> None:
    acc = DynamicSamplingAccumulator(train_batch_size=3, n=2)
    b1, ids1, m1 = _gen_batch([0, 1, 2], 2, [[1, 1], [1, 0], [0, 0]], "x")  # keeps prompt 1
    acc.add(b1, ids1, m1)
    assert not acc.is_full() and acc.num_prompts_kept == 1
    acc.add({"responses": torch.zeros(0, 3, dtype=torch.long), "tag": [], "uid_np": np.array([])}, [], [])
    assert acc.num_gen_batches == 2 and acc.num_prompts_generated == 3
    b3, ids3, m3 = _gen_batch([0, 1, 2], 2, [[0, 1], [1, 1], [1, 0]], "yy")  # same ids, new prompts: keeps 0, 2
    acc.add(b3, ids3, m3)
    assert acc.is_full() and acc.num_prompts_kept == 3
    assert acc.kept_ratio == pytest.approx(3 / 6)
    metrics = acc.metrics()
    assert metrics["train/num_gen_batches"] == 3.0 and metrics["train/kept_prompt_ratio"] == pytest.approx(0.5)
    out, gids = acc.take(return_group_ids=True)
    assert out["tag"] == ["x2", "x3", "yy0", "yy1", "yy4", "yy5"]
    assert torch.equal(out["responses"], torch.cat([b1["responses"][2:4], b3["responses"][[0, 1, 4, 5]]]))
    assert out["uid_np"].tolist() == [1, 1, 0, 0, 2, 2]
    assert gids == [(0, 1), (0, 1), (2, 0), (2, 0), (2, 2), (2, 2)]
    assert acc.num_gen_batches == 0 and acc.num_prompts_kept == 0  # reset for the next step


def test_accumulator_surplus_is_discarded() -> None:
    acc = DynamicSamplingAccumulator(train_batch_size=1, n=2)
    batch, ids, metric = _gen_batch([5, 6], 2, [[1, 0], [0, 1]], "z")
    acc.add(batch, ids, metric)
    out = acc.take()
    assert out["tag"] == ["z0", "z1"]
    with pytest.raises(RuntimeError, match="before the batch is full"):
        acc.take()


def test_accumulator_disabled_keeps_everything() -> None:
    acc = DynamicSamplingAccumulator(train_batch_size=2, n=2, enable=False)
    batch, ids, _ = _gen_batch([0, 1], 2, [[1, 1], [0, 0]], "w")
    acc.add(batch, ids)
    assert acc.is_full() and acc.take()["tag"] == ["w0", "w1", "w2", "w3"]


def test_check_budget() -> None:
    acc = DynamicSamplingAccumulator(train_batch_size=4, n=2)
    for _ in range(3):
        batch, ids, metric = _gen_batch([0, 1], 2, [[1, 1], [1, 0]], "q")
        acc.add(batch, ids, metric)
        acc.check_budget(0)  # unlimited
    acc.check_budget(4)  # 3 < 4 batches: fine
    with pytest.raises(RuntimeError) as info:
        acc.check_budget(3)
    msg = str(info.value)
    assert "kept 3 of 6 generated prompts" in msg
    assert "max_num_gen_batches=3" in msg and "data.gen_batch_size" in msg and "rewards" in msg
    batch, ids, metric = _gen_batch([0], 2, [[0, 1]], "r")
    acc.add(batch, ids, metric)
    acc.check_budget(3)  # full now: no error even though the budget is spent


def test_accumulator_input_errors() -> None:
    acc = DynamicSamplingAccumulator(train_batch_size=1, n=2)
    with pytest.raises(ValueError, match="has 3 rows"):
        acc.add({"x": [1, 2, 3]}, [0, 0], [1, 0])
    with pytest.raises(ValueError, match="metric_values are required"):
        acc.add({"x": [1, 2]}, [0, 0])
    with pytest.raises(ValueError, match="must be positive"):
        DynamicSamplingAccumulator(0, 2)


@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.lists(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=3, max_size=3), max_size=4), max_size=6),
)
@settings(max_examples=60, deadline=None)
def test_accumulator_matches_verl_loop(train_batch_size, n, gen_batches) -> None:
    """verl: concat the kept trajectories of each generation batch until enough prompts, then batch[:bsz * n]."""
    acc = DynamicSamplingAccumulator(train_batch_size, n)
    verl_rows: list[str] = []
    verl_prompts = 0
    for b, prompts in enumerate(gen_batches):
        accs = [row[:n] for row in prompts]
        batch, ids, metric = _gen_batch(list(range(len(prompts))), n, accs, f"g{b}_")
        keep = ref_keep(metric, ids)
        verl_rows += [t for t, k in zip(batch["tag"], keep, strict=True) if k]
        verl_prompts += len({g for g, k in zip(ids, keep, strict=True) if k})
        acc.add(batch, ids, metric)
        assert acc.is_full() == (verl_prompts >= train_batch_size)
        if acc.is_full():
            out = acc.take()
            assert out["tag"] == verl_rows[: train_batch_size * n]
            assert out["responses"].shape == (train_batch_size * n, 3)
            verl_rows, verl_prompts = [], 0


def test_take_partial_fills_with_dropped_groups_and_marks_them():
    acc = DynamicSamplingAccumulator(train_batch_size=3, n=2)
    # gen batch 0: group "a" mixed (kept), group "b" all-equal (dropped)
    acc.add({"x": torch.tensor([1.0, 2.0, 3.0, 4.0])}, ["a", "a", "b", "b"], [1.0, 0.0, 1.0, 1.0])
    assert not acc.is_exhausted(2) and acc.is_exhausted(1)
    # gen batch 1: both dropped
    acc.add({"x": torch.tensor([5.0, 6.0, 7.0, 8.0])}, ["c", "c", "d", "d"], [0.0, 0.0, 1.0, 1.0])
    assert acc.is_exhausted(2) and not acc.is_full()
    with pytest.raises(RuntimeError, match="on_exhausted=train"):
        acc.check_budget(2)
    batch, ids, filler = acc.take_partial()
    # kept group first, then the first dropped groups in arrival order as filler
    assert batch["x"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert filler.tolist() == [False, False, True, True, True, True]
    assert ids == [(0, "a"), (0, "a"), (0, "b"), (0, "b"), (1, "c"), (1, "c")]
    assert acc.num_gen_batches == 0  # reset for the next step


def test_take_partial_with_nothing_kept_is_all_filler_and_reuses_groups():
    acc = DynamicSamplingAccumulator(train_batch_size=3, n=2)
    acc.add({"x": torch.tensor([1.0, 2.0])}, ["a", "a"], [1.0, 1.0])
    batch, ids, filler = acc.take_partial()
    assert filler.all() and batch["x"].tolist() == [1.0, 2.0] * 3
    assert len(ids) == 6


def test_take_partial_with_every_group_kept_and_too_few_names_the_cause():
    acc = DynamicSamplingAccumulator(train_batch_size=3, n=2)
    acc.add({"x": torch.tensor([1.0, 2.0])}, ["a", "a"], [1.0, 0.0])  # kept: nothing was dropped to fill with
    with pytest.raises(RuntimeError, match=r"kept all 1 groups .* fewer than the 3 a batch needs"):
        acc.take_partial()


def test_is_exhausted_is_never_true_for_an_unlimited_budget_or_a_full_batch():
    acc = DynamicSamplingAccumulator(train_batch_size=1, n=2)
    acc.add({"x": torch.tensor([1.0, 2.0])}, ["a", "a"], [1.0, 1.0])
    assert not acc.is_exhausted(0)
    acc.add({"x": torch.tensor([1.0, 2.0])}, ["a", "a"], [1.0, 0.0])
    assert acc.is_full() and not acc.is_exhausted(1)
