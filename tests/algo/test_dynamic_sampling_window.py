"""Dynamic sampling per trained batch where groups end one by one and the kept ones are handed on at once
(algo/dynamic_sampling.py, the async rollout ranks' side of algo/dynamic_sampling.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo.dynamic_sampling import TrainedBatchWindow, gen_batch_budget

MIXED, EQUAL = [1.0, 0.0], [1.0, 1.0]


def _group(key: str, rewards: list[float]) -> tuple[dict, str, torch.Tensor]:
    """A scored group of len(rewards) rows; x = 10 * ord(key) + row, so every row says where it came from."""
    rows = {"x": torch.arange(len(rewards), dtype=torch.float64) + 10 * ord(key)}
    return rows, key, torch.tensor(rewards)


def _add(w: TrainedBatchWindow, groups: str, rewards: list[float]) -> list[bool]:
    return [w.add(*_group(key, rewards)) for key in groups]


def test_kept_groups_are_handed_on_and_the_group_that_fills_the_batch_closes_the_window():
    w = TrainedBatchWindow(train_batch_size=3, n=2, gen_batch_size=2, enable=True, max_num_gen_batches=2)
    assert _add(w, "a", MIXED) + _add(w, "b", EQUAL) == [True, False]
    assert w.acc.num_gen_batches == 1 and w.num_prompts_kept == 1 and not w.exhausted
    assert _add(w, "cd", MIXED) == [True, True]  # d is the third kept group: the window closes there
    assert w.acc.num_gen_batches == 0 and w.num_prompts_kept == 0
    assert w.totals == {"gen_batches": 2, "generated": 4, "kept": 3}
    assert _add(w, "e", MIXED) == [True]  # the next group opens the next batch with a new generation batch
    assert w.totals == {"gen_batches": 3, "generated": 5, "kept": 4} and w.num_prompts_kept == 1


def test_an_exhausted_window_is_filled_with_dropped_groups_as_a_synchronous_step():
    w = TrainedBatchWindow(train_batch_size=3, n=2, gen_batch_size=2, enable=True, max_num_gen_batches=2)
    _add(w, "a", MIXED)
    _add(w, "bc", EQUAL)
    assert not w.exhausted  # one generation batch and a half
    _add(w, "d", EQUAL)
    assert w.exhausted and w.acc.num_gen_batches == 2
    batch, ids = w.take_filler()
    # "a" was handed on already; the filler is the first dropped groups in the order they ended: b, c
    assert ids == ["b", "b", "c", "c"]
    assert batch["x"].tolist() == [10 * ord("b"), 10 * ord("b") + 1, 10 * ord("c"), 10 * ord("c") + 1]
    assert w.acc.num_gen_batches == 0 and not w.exhausted  # the next window
    assert w.totals == {"gen_batches": 2, "generated": 4, "kept": 1}


def test_filler_reuses_dropped_groups_when_too_few():
    w = TrainedBatchWindow(train_batch_size=3, n=2, gen_batch_size=1, enable=True, max_num_gen_batches=1)
    _add(w, "a", EQUAL)
    _, ids = w.take_filler()
    assert ids == ["a", "a"] * 3


def test_close_gives_check_budgets_message_of_the_window():
    w = TrainedBatchWindow(train_batch_size=2, n=2, gen_batch_size=1, enable=True, max_num_gen_batches=3)
    with pytest.raises(RuntimeError, match="not exhausted"):
        w.close()
    _add(w, "xyz", EQUAL)
    message = w.close()
    assert message.startswith("dynamic sampling kept 0 of 3 generated prompts (6 trajectories) after 3 generation")
    assert "needs 2 prompts" in message and "max_num_gen_batches=3" in message and "on_exhausted=train" in message
    assert w.acc.num_gen_batches == 0


def test_filtering_off_keeps_everything_and_exhausts_only_as_a_synchronous_step_does():
    w = TrainedBatchWindow(train_batch_size=2, n=2, gen_batch_size=2, enable=False, max_num_gen_batches=1)
    assert _add(w, "ab", EQUAL) == [True, True] and not w.exhausted and w.acc.num_gen_batches == 0
    # one generation batch of one group cannot fill a batch of two: exhausted, as a synchronous step would be
    w = TrainedBatchWindow(train_batch_size=2, n=2, gen_batch_size=1, enable=False, max_num_gen_batches=1)
    assert _add(w, "a", EQUAL) == [True] and w.exhausted


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        TrainedBatchWindow(2, 2, 2, True, 0)


def test_a_budget_of_zero_is_one_pass_over_the_prompts():
    assert gen_batch_budget(4, 100, 8) == 4
    assert gen_batch_budget(0, 100, 8) == 13 and gen_batch_budget(0, 96, 8) == 12


def test_a_window_that_dropped_nothing_has_no_filler():
    # every group kept and still too few: one generation batch of one group for a batch of two
    w = TrainedBatchWindow(train_batch_size=2, n=2, gen_batch_size=1, enable=True, max_num_gen_batches=1)
    _add(w, "a", MIXED)
    assert w.exhausted and w.take_filler() is None
    assert w.close().startswith("dynamic sampling kept 1 of 1 generated prompts (2 trajectories) after 1 generation")
