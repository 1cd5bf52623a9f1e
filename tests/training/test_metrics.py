"""``reporting.metrics`` (verl's metric names and semantics) on a hand-computed batch, and ``reporting.timing``."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_dapo.batch import TrainBatch
from megatron_dapo.platform.cpu import CpuPlatform
from megatron_dapo.reporting.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_val_metrics,
    reduce_metrics,
)
from megatron_dapo.reporting.timing import Timer, timed

GARBAGE = 100.0  # values at masked positions: must never show up in a statistic


def hand_batch() -> TrainBatch:
    """4 sequences, prompt width 3, response width 4. Row 2's response is empty (an aborted sample)."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])  # lengths 2, 3, 1, 3
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])  # lengths 4, 2, 0, 1
    scores = torch.zeros(4, 4)
    scores[0, 3], scores[1, 1], scores[2, 0], scores[3, 0] = 1.0, 0.5, 9.0, -1.0  # row 2 (aborted) is excluded
    rewards = scores - 0.1 * (scores != 0).float()
    adv_per_row = torch.tensor([1.5, -0.5, 7.0, -2.0])
    advantages = torch.where(response_mask.bool(), adv_per_row[:, None].expand(4, 4), torch.tensor(GARBAGE))
    returns = torch.where(response_mask.bool(), 2 * adv_per_row[:, None].expand(4, 4), torch.tensor(GARBAGE))
    return TrainBatch(
        prompts=torch.zeros(4, 3, dtype=torch.long),
        prompt_mask=prompt_mask,
        responses=torch.zeros(4, 4, dtype=torch.long),
        response_mask=response_mask,
        token_level_scores=scores,
        token_level_rewards=rewards,
        advantages=advantages,
        returns=returns,
    )


EXPECTED = {
    "critic/score/mean": (1.0 + 0.5 - 1.0) / 3,
    "critic/score/max": 1.0,
    "critic/score/min": -1.0,
    "critic/rewards/mean": (0.9 + 0.4 - 1.1) / 3,
    "critic/rewards/max": 0.9,
    "critic/rewards/min": -1.1,
    # 4 tokens of 1.5, 2 of -0.5, 1 of -2.0 (row 2 has no response tokens)
    "critic/advantages/mean": (6.0 - 1.0 - 2.0) / 7,
    "critic/advantages/max": 1.5,
    "critic/advantages/min": -2.0,
    "critic/returns/mean": (12.0 - 2.0 - 4.0) / 7,
    "critic/returns/max": 3.0,
    "critic/returns/min": -4.0,
    "response_length/mean": 7 / 4,
    "response_length/max": 4.0,
    "response_length/min": 0.0,
    "response_length/clip_ratio": 1 / 4,
    "response_length_non_aborted/mean": 7 / 3,
    "response_length_non_aborted/max": 4.0,
    "response_length_non_aborted/min": 1.0,
    "response_length_non_aborted/clip_ratio": 1 / 3,
    "response/aborted_ratio": 1 / 4,
    "prompt_length/mean": 9 / 4,
    "prompt_length/max": 3.0,
    "prompt_length/min": 1.0,
    "prompt_length/clip_ratio": 2 / 4,
}


def test_data_metrics_match_hand_values() -> None:
    got = compute_data_metrics(hand_batch())
    assert set(got) == set(EXPECTED)
    for key, value in EXPECTED.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_data_metrics_budgets_and_rewards_default() -> None:
    # Budgets larger than the padded widths: nothing is clipped.
    got = compute_data_metrics(hand_batch(), max_prompt_length=5, max_response_length=8)
    assert got["prompt_length/clip_ratio"] == 0.0 and got["response_length/clip_ratio"] == 0.0
    # Without token_level_rewards (no KL in the reward) the rewards are the scores.
    batch = hand_batch()
    batch.token_level_rewards = None
    got = compute_data_metrics(batch)
    assert got["critic/rewards/mean"] == pytest.approx(got["critic/score/mean"])


def test_data_metrics_errors() -> None:
    batch = hand_batch()
    batch.response_mask = torch.zeros(4, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="every response in the batch is empty"):
        compute_data_metrics(batch)


def test_timing_and_throughput_metrics() -> None:
    timings = {"gen": 2.0, "update_actor": 3.0, "old_log_prob": 0.8, "reward": 0.5, "step": 6.0}
    got = compute_timing_metrics(timings, hand_batch())
    # 9 prompt tokens, 7 response tokens: gen per response token, the model passes per prompt+response token.
    assert got == pytest.approx(
        {
            "timing_s/gen": 2.0,
            "timing_s/update_actor": 3.0,
            "timing_s/old_log_prob": 0.8,
            "timing_s/reward": 0.5,
            "timing_s/step": 6.0,
            "timing_per_token_ms/gen": 2000.0 / 7,
            "timing_per_token_ms/update_actor": 3000.0 / 16,
            "timing_per_token_ms/old_log_prob": 800.0 / 16,
        }
    )
    perf = compute_throughput_metrics(hand_batch(), timings, n_gpus=2)
    assert perf == pytest.approx({"perf/total_num_tokens": 16, "perf/time_per_step": 6.0, "perf/throughput": 16 / 12})
    with pytest.raises(KeyError, match="no 'step' entry"):
        compute_throughput_metrics(hand_batch(), {"gen": 1.0}, n_gpus=1)


def test_val_metrics_per_data_source() -> None:
    got = compute_val_metrics(["math", "gsm8k", "math", "math", "gsm8k", "math"], [1, 0, 0, 1, 1, 1.0], n=2)
    assert got == pytest.approx({"val-core/math/acc/mean@2": 3 / 4, "val-core/gsm8k/acc/mean@2": 1 / 2})
    with pytest.raises(ValueError, match="2 data sources but 3 accuracies"):
        compute_val_metrics(["a", "b"], [1, 0, 1], n=1)


def test_reduce_metrics() -> None:
    got = reduce_metrics(
        [
            {
                "actor/pg_loss": 1.0,
                "response_length/max": 3,
                "critic/score/min": 0.5,
                "timing_s/gen": 1.0,
                "perf/max_memory_allocated_gb": 2.0,
            },
            {
                "actor/pg_loss": 2.0,
                "response_length/max": 5,
                "critic/score/min": -1.0,
                "timing_s/gen": 3.0,
                "perf/max_memory_allocated_gb": 1.0,
                "actor/grad_norm": torch.tensor(4.0),
            },
        ]
    )
    assert got == {
        "actor/pg_loss": 1.5,
        "response_length/max": 5.0,
        "critic/score/min": -1.0,
        "timing_s/gen": 2.0,  # "timing" contains "min" as letters, not as a word: averaged
        "perf/max_memory_allocated_gb": 2.0,
        "actor/grad_norm": 4.0,  # present in one dict only: its value
    }
    assert reduce_metrics([]) == {}
    with pytest.raises(TypeError, match="'actor/x' has a non-numeric value 'a'"):
        reduce_metrics([{"actor/x": "a"}])
    with pytest.raises(ValueError, match=r"tensor of shape \(2,\)"):
        reduce_metrics([{"actor/x": torch.ones(2)}])


class CountingCpuPlatform(CpuPlatform):
    """The CPU platform (not set up: this pytest process stays free of the shims), counting synchronize calls."""

    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1
        super().synchronize()


def test_timed_accumulates_and_synchronizes() -> None:
    # Each measured block is bracketed by the test's own clock reads: a timer's interval lies inside the bracket and
    # holds the block's sleep, so it is checked between the two, whatever the load of the machine (no fixed limit).
    platform = CountingCpuPlatform()
    timings: dict[str, float] = {}
    bracket = 0.0
    for _ in range(2):
        outer = time.perf_counter()
        with timed("gen", timings, platform):
            time.sleep(0.05)
        bracket += time.perf_counter() - outer
    assert 0.1 <= timings["gen"] <= bracket  # both blocks, accumulated
    assert platform.syncs == 4  # before reading the clock at every start and stop
    outer = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom"), timed("update_actor", timings, platform):
        time.sleep(0.02)
        raise RuntimeError("boom")
    assert 0.02 <= timings["update_actor"] <= time.perf_counter() - outer  # a failing phase still reports its time

    timer = Timer("t", platform)
    with pytest.raises(RuntimeError, match="'t' was stopped without being started"):
        timer.stop()
    outer = time.perf_counter()
    with timer:
        time.sleep(0.01)
    first = timer.elapsed
    assert 0.01 <= first <= time.perf_counter() - outer
    timer.start()
    with pytest.raises(RuntimeError, match="'t' is already running"):
        timer.start()
    timer.stop()
    assert timer.elapsed > first  # the second interval added to the first


def test_startup_clock_reports_its_parts_once() -> None:
    from megatron_dapo.reporting.timing import StartupClock

    clock = StartupClock()
    clock.mark("init")
    clock.mark("engine")
    clock.mark_total()
    times = clock.pop()
    assert set(times) == {"startup/imports", "startup/init", "startup/engine", "startup"}
    assert all(v >= 0 for v in times.values())
    assert times["startup"] >= times["startup/imports"]  # both from the process's launch
    assert clock.pop() == {}  # reported with the first step only
