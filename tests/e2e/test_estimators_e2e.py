"""verl's estimators that need more than the rollout's rewards, through a real training step (torchrun, 2 CPU
processes, vLLM + megatron-core) on the embedded task; their math is held to verl's by
``tests/algo/test_verl_golden_estimators.py``.

* ``remax``: every generation round also generates one greedy response per prompt and scores it (``timing_s/gen_max``,
  and the reward function's call count); with a constant reward every advantage (reward minus that baseline) is 0;
* ``gdpo``: the reward function's ``acc`` and ``score`` (its returned dict) are normalised one by one and whitened over
  the batch's tokens: the token mean of the advantages is 0 and their spread 1;
* ``optimal_token_baseline``: the proximal forward runs even on an on-policy step, for the old policy's ``Σ π²``.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_train_e2e import launch, overrides, read_metrics, wait_ok

CONSTANT_REWARD = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({log!r}, "a") as f:  # one line per scored response (both ranks score their share)
        f.write("x\\n")
    return 1.0
"""


@pytest.mark.slow
def test_remax_generates_and_scores_a_greedy_baseline(demo, tmp_path):
    """Every round scores its 6 prompts x 8 responses and one greedy response per prompt (6 more); with a constant
    reward the greedy baseline equals every return, so every advantage is 0 while the returns are 1."""
    out, log = tmp_path / "remax", tmp_path / "calls.txt"
    reward = tmp_path / "reward.py"
    reward.write_text(CONSTANT_REWARD.format(log=str(log)))
    extra = {
        "algorithm.adv_estimator": "remax",
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
        "reward.custom_function.path": str(reward),
    }
    wait_ok(
        launch("run_local.sh", overrides(demo, out, steps=2, **extra), {"NPROC_PER_NODE": "2", "MASTER_PORT": "29984"})
    )
    trained = [r for r in read_metrics(out) if "actor/pg_loss" in r]
    assert len(trained) == 2
    for r in trained:
        assert r["timing_s/gen_max"] > 0
        assert r["critic/returns/mean"] == 1.0
        assert r["critic/advantages/max"] == r["critic/advantages/min"] == 0.0
    assert len(log.read_text().splitlines()) == 2 * (6 * 8 + 6)


@pytest.mark.slow
def test_gdpo_whitens_its_per_dimension_advantages(demo, tmp_path):
    out = tmp_path / "gdpo"
    extra = {
        "algorithm.adv_estimator": "gdpo",
        "algorithm.gdpo_reward_keys": "[acc,score]",
        "algorithm.gdpo_reward_weights": "[1.0,0.5]",
        "trainer.test_freq": -1,
    }
    wait_ok(
        launch("run_local.sh", overrides(demo, out, steps=2, **extra), {"NPROC_PER_NODE": "2", "MASTER_PORT": "29985"})
    )
    trained = [r for r in read_metrics(out) if "actor/pg_loss" in r]
    assert len(trained) == 2
    for r in trained:
        assert abs(r["critic/advantages/mean"]) < 1e-5
        assert 0.5 < r["critic/advantages/max"] - r["critic/advantages/min"]


@pytest.mark.slow
def test_optimal_token_baseline_runs_the_proximal_forward_for_sum_pi_squared(demo, tmp_path):
    """An on-policy step would skip the proximal forward; the optimal token baseline needs its ``Σ π²``, so it runs."""
    out = tmp_path / "otb"
    args = overrides(
        demo, out, steps=2, **{"algorithm.adv_estimator": "optimal_token_baseline", "trainer.test_freq": -1}
    )
    wait_ok(launch("run_local.sh", args, {"NPROC_PER_NODE": "2", "MASTER_PORT": "29986"}))
    trained = [r for r in read_metrics(out) if "actor/pg_loss" in r]
    assert len(trained) == 2
    for r in trained:
        assert r["timing_s/old_log_prob"] > 0
        assert r["rollout/logprob_diff_mean"] < 1e-2  # the proximal forward scored the rollout's tokens
        assert r["critic/advantages/max"] > r["critic/advantages/min"]
