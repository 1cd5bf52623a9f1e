"""The actor's collectives are device-safe: under a platform that refuses host-built (CPU) tensors on its device
groups, ``compute_log_probs`` and ``update`` with DP=2 and with PP=2 put only device tensors on them (see
``device_collectives_worker.py`` for how host-built tensors are told apart on the CPU box)."""

import json
from pathlib import Path

import pytest

from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("device_collectives_worker.py")


@pytest.mark.parametrize("layout", [[], ["--pp", "2"]], ids=["dp2", "pp2"])
def test_actor_collectives_carry_device_tensors_only(layout, tmp_path):
    run_torchrun(WORKER, 2, layout + ["--out", str(tmp_path)], port=29768, timeout=600)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["violations"] == [], result["violations"]
        assert result["canary_seen"], "the host-tensor check did not see a deliberate violation"
        assert result["update_ok"] == 1.0
