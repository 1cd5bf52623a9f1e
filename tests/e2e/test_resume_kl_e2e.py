"""A resumed run continues the adaptive KL controller (``algorithm.kl_ctrl.type=adaptive`` with KL in the reward)
instead of restarting it at ``kl_coef``, and the trainer's counters come back with it (``trainer_state.json``'s
``kl_ctrl`` and ``trainer`` entries).

One process, the tiny demo model, no validation: a 2-step run saving after each step, and a second run resumed from
its step-1 checkpoint (into another output directory) for step 2. The coefficient step 2 uses is the one step 1's
update produced: equal in both runs, bit for bit, and far from ``kl_coef``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_train_e2e import launch, overrides, read_metrics, wait_ok

KL_COEF = 0.05
ENV = {"NPROC_PER_NODE": "1", "MASTER_PORT": "29969"}


def kl_overrides(demo: dict, out: Path, **extra) -> list[str]:
    # Horizon 10 with 32 responses a step: one update moves the coefficient by up to 64 % (the first step's KL is
    # ~0, the policy being the reference: x0.36), so a restart at kl_coef cannot pass for a continuation.
    settings = {
        "algorithm.use_kl_in_reward": "true",
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.kl_coef": KL_COEF,
        "algorithm.kl_ctrl.target_kl": 0.01,
        "algorithm.kl_ctrl.horizon": 10,
        "trainer.val_before_train": "false",
        "trainer.test_freq": -1,
        "data.val_files": "[]",
        "checkpoint.save_freq": 1,
        "actor.optim.lr_warmup_steps": 0,  # step 1 moves the policy: step 2 has a KL to penalise
        **extra,
    }
    return overrides(demo, out, steps=2, **settings)


def test_resume_continues_the_adaptive_kl_controller(demo, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    wait_ok(launch("run_local.sh", kl_overrides(demo, straight), ENV))
    step1 = straight / "checkpoints" / "global_step_1"
    wait_ok(launch("run_local.sh", kl_overrides(demo, resumed, **{"checkpoint.resume_mode": str(step1)}), ENV))

    first = {r["step"]: r for r in read_metrics(straight)}
    second = {r["step"]: r for r in read_metrics(resumed)}
    assert sorted(first) == [1, 2] and sorted(second) == [2]  # the resumed run did step 2 only
    coeff = "actor/reward_kl_penalty_coeff"
    assert first[1][coeff] == KL_COEF
    assert first[2][coeff] != pytest.approx(KL_COEF, rel=0.05)  # step 1's update moved it
    assert second[2][coeff] == first[2][coeff]  # continued, not restarted
    for key in ("actor/reward_kl_penalty", "critic/rewards/mean", "actor/pg_loss"):
        assert second[2][key] == pytest.approx(first[2][key], rel=1e-5, abs=1e-7), key

    saved = json.loads((step1 / "trainer_state.json").read_text())
    assert saved["kl_ctrl"] == {"type": "adaptive", "value": first[2][coeff]}
    assert saved["trainer"] == {
        "num_skipped_updates": 0,
        "consecutive_skipped_updates": 0,
        "num_partial_batches": 0,
        "num_empty_steps": 0,
    }
    # Step 2's update of the controller is the same in both runs too.
    ends = [
        json.loads((run / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
        for run in (straight, resumed)
    ]
    assert ends[1]["kl_ctrl"]["value"] == pytest.approx(ends[0]["kl_ctrl"]["value"], rel=1e-6)
    assert ends[1]["data_state"] == ends[0]["data_state"]
