"""A DAPO update of a tiny Qwen3-MoE actor with expert parallelism 2 (experts split over the two processes, tokens
exchanged by megatron-core's all-to-all over gloo): the step applies, every parameter moves, and the expert load the
actor logs counts each non-padding token ``topk`` times in every MoE layer and none in the dense one."""

from pathlib import Path

import pytest
import torch

from tests.distributed.loss_batch import make_batch
from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("moe_update_worker.py")


@pytest.mark.parametrize("world", [1, 2], ids=["ep1", "ep2"])
def test_moe_update_with_expert_parallelism(world, tmp_path):
    run_torchrun(WORKER, world, ["--out", str(tmp_path)], port=29767, timeout=600)
    b = make_batch()
    tokens = int(b["prompt_mask"].sum() + b["response_mask"].sum())
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for res in results:
        m = res["metrics"]
        assert m["actor/update_ok"] == 1.0 and res["moved"] == 1.0
        counts = res["counts"]
        for layer in range(counts.shape[0]):
            expected = res["topk"] * tokens if layer in res["moe_layers"] else 0
            assert counts[layer].sum().item() == expected, (layer, counts[layer])
        assert 0 < m["actor/moe_expert_load/min"] <= m["actor/moe_expert_load/max"]
        assert m["actor/moe_expert_load/max"] == counts.max().item()
        torch.testing.assert_close(counts, results[0]["counts"])  # every rank reports the whole step
    assert results[0]["metrics"]["actor/pg_loss"] == pytest.approx(results[-1]["metrics"]["actor/pg_loss"])
