"""Forward-only passes build no autograd graph (``tests/training/forward_only_worker.py``, 2 processes).

megatron-core's schedules do not turn autograd off for ``forward_only``; without ``no_grad`` every micro-batch's
activations stayed alive, held by the results, until the pass ended (measured on an H200: 62.7 GB above the resident
state for a 0.63B model's old-log-prob pass, against 2.3 GB without the graph).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("forward_only_worker.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("forward_only") / "report.json"
    run_torchrun(WORKER, nproc=2, args=["--out", str(out)], port=29891, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_log_prob_pass_saves_nothing_for_backward(report, layout):
    for case in ("few", "many"):
        assert report[layout][case]["saved"] == 0, report[layout]


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_log_prob_pass_memory_does_not_grow_with_micro_batches(report, layout):
    few, many = report[layout]["few"], report[layout]["many"]
    # 4x the micro-batches: the pass grows by what its inputs and results do (on CPU the micro-batches' tensors, a
    # few copies of the batch's, are "device" memory), not by a graph per micro-batch (before the fix: +2.1 MB at
    # dp2, 190x the batch's bytes).
    assert many["transient"] - few["transient"] <= 4 * many["batch_bytes"], report[layout]
