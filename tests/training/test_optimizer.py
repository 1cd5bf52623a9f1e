"""``actor.optimizer``: megatron-core Adam (plain / distributed, fp32 / bf16, DP=2 and TP=2) against a float64
hand-written AdamW, the returned grad norm against a float64 global norm, and the lr schedule against hand values.

One torchrun (world 2) runs every case (see ``optimizer_worker.py``); this module asserts on its numbers.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megatron_dapo.config import OptimConfig, lr_schedule_problems, warmup_steps
from tests.helpers import run_torchrun
from tests.training.optimizer_worker import SCHEDULE_TOTAL

WORKER = Path(__file__).with_name("optimizer_worker.py")
PORT = 29850
PARAM_RTOL = 1e-6  # max |p - p_ref| / max |p_ref| per tensor (fp32 params, or the fp32 main params of bf16)
UPDATE_RTOL = 2e-5  # the same for the update p - p_0 (what Adam changed), which is ~10-50% of |p| here
NORM_RTOL = 2e-6  # megatron's fp32 grad norm vs float64

EXPECTED_TYPES = {
    "fp32-plain": ["FP32Optimizer"],
    "fp32-distopt": ["DistributedOptimizer"],
    "bf16-plain": ["Float16OptimizerWithFloat16Params"],
    "bf16-distopt": ["DistributedOptimizer"],
    "fp32-tp2": ["FP32Optimizer"],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("optimizer")
    run_torchrun(WORKER, nproc=2, args=["--out", str(out)], port=PORT, timeout=400)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(EXPECTED_TYPES))
def test_adam_step_matches_float64_reference(ranks: list[dict], case: str) -> None:
    results = [r["cases"][case] for r in ranks]
    for res in results:
        assert res["optimizer_types"] == EXPECTED_TYPES[case]
        assert (res["dp"], res["tp"]) == ((1, 2) if case == "fp32-tp2" else (2, 1))
        assert res["update_rel"] <= UPDATE_RTOL
        if case.startswith("fp32"):
            assert res["param_rel"] <= PARAM_RTOL
        else:
            assert res["main_rel"] <= PARAM_RTOL
            assert res["bf16_mismatch"] == 0  # bf16 params == fp32 main params rounded
            assert res["bf16_excess"] <= 1e-6  # beyond half a bf16 ulp of the reference
    if case == "bf16-distopt":  # the two DP ranks' main shards partition the model
        assert sum(r["main_elements"] for r in results) == results[0]["model_elements"]
        assert 0 < results[0]["main_elements"] < results[0]["model_elements"]
    elif case == "bf16-plain":
        assert all(r["main_elements"] == r["model_elements"] for r in results)


@pytest.mark.parametrize("case", list(EXPECTED_TYPES))
def test_grad_norm_is_global_float64_norm(ranks: list[dict], case: str) -> None:
    for res in (r["cases"][case] for r in ranks):
        (first, second) = res["norms"]
        assert first["clipped"] and not second["clipped"]  # step 1 exercises clipping, step 2 does not
        assert first["reference"] > 1.0 > second["reference"]
        for n in (first, second):
            assert n["ok"]
            assert abs(n["megatron"] - n["reference"]) <= NORM_RTOL * n["reference"]
    # Every rank reports the same (global) norm.
    assert ranks[0]["cases"][case]["norms"] == ranks[1]["cases"][case]["norms"]


def _hand_schedule(style: str, lr: float, min_lr: float, warmup: int, total: int, steps: int) -> list[float]:
    out = []
    for s in range(steps):
        if warmup > 0 and s <= warmup:
            out.append(lr * s / warmup)
        elif style == "constant":
            out.append(lr)
        elif s > total:
            out.append(min_lr)
        else:
            ratio = (s - warmup) / (total - warmup)
            coeff = 1 - ratio if style == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
            out.append(min_lr + coeff * (lr - min_lr))
    return out


@pytest.mark.parametrize(
    "style,warmup",
    [("constant", 2), ("cosine", 2), ("linear", 3)],  # linear: lr_warmup_steps=3 wins over the ratio (0.5 -> 4)
)
def test_lr_schedule_matches_hand_values(ranks: list[dict], style: str, warmup: int) -> None:
    got = ranks[0]["schedules"][style]
    expected = _hand_schedule(style, 2e-3, 2e-4, warmup, SCHEDULE_TOTAL, SCHEDULE_TOTAL + 3)
    assert [len(v) for v in got["lrs"]] == [1] * len(expected)  # every param group has the same lr
    assert [v[0] for v in got["lrs"]] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # Weight decay is constant; biases and 1-D params (norms) are in a no-decay group.
    assert all(w == [0.0, 0.05] for w in got["wds"])
    assert ranks[1]["schedules"] == ranks[0]["schedules"]


def test_lr_schedule_spot_values(ranks: list[dict]) -> None:
    cosine = [v[0] for v in ranks[0]["schedules"]["cosine"]["lrs"]]
    # warm-up 0 -> 1e-3 -> 2e-3, cosine midpoint (step 5 of 2..8) = (2e-3 + 2e-4) / 2, min_lr from step 8 on.
    assert cosine[:3] == pytest.approx([0.0, 1e-3, 2e-3])
    assert cosine[5] == pytest.approx(1.1e-3)
    assert cosine[8:] == pytest.approx([2e-4] * 3)


def test_warmup_resolution_and_errors() -> None:
    # The schedule's rule runs in the gate (config/plan.resolve); the optimizer takes the warm-up as it is.
    assert warmup_steps(OptimConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.1), 25) == 2
    assert warmup_steps(OptimConfig(lr_warmup_steps=5, lr_warmup_steps_ratio=0.1), 25) == 5
    assert warmup_steps(OptimConfig(), 1) == 0
    assert lr_schedule_problems(OptimConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.1), 25) == []

    def problem(optim: OptimConfig, steps: int) -> str:
        return "\n".join(lr_schedule_problems(optim, steps))

    too_long = problem(OptimConfig(lr_warmup_steps=10), 10)
    assert re.search("lr_warmup_steps=10.*shorter than the 10 training steps", too_long)
    assert "lr_decay_style='step'" in problem(OptimConfig(lr_decay_style="step"), 10)  # type: ignore[arg-type]
    assert "min_lr" in problem(OptimConfig(lr=1e-3, min_lr=1e-2), 10)
    assert ">= 1" in problem(OptimConfig(), 0)
