"""End-to-end DAPO on a tiny Qwen3-MoE model with expert parallelism EP=2 under torchrun on CPU
(configs/tiny_moe_cpu.yaml): vLLM rollout of the MoE model, weight sync of each EP rank's experts into vLLM's
fused-MoE layout, the update through megatron-core's MoE layers (alltoall dispatcher), checkpoints with the experts
split over EP ranks, resume, and an HF export that transformers loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_train_e2e import (
    REPO,
    REQUIRED_METRICS,
    assert_same_as_straight,
    export,
    launch,
    overrides,
    read_metrics,
    wait_ok,
)

CONFIG = REPO / "configs" / "tiny_moe_cpu.yaml"
ENV = {"NPROC_PER_NODE": "2", "MASTER_PORT": "29973"}
MOE_METRICS = ["actor/moe_expert_load/min", "actor/moe_expert_load/max"]


@pytest.fixture(scope="module")
def straight_moe(demo_moe, tmp_path_factory) -> Path:
    """An uninterrupted 3-step EP=2 run with a checkpoint at every step."""
    out = tmp_path_factory.mktemp("straight_moe")
    wait_ok(launch("run_local.sh", overrides(demo_moe, out, steps=3, **{"checkpoint.save_freq": 1}), ENV, CONFIG))
    return out


def test_moe_ep2_run_metrics_sync_and_export(demo_moe, straight_moe, tmp_path):
    rows = read_metrics(straight_moe)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        missing = [k for k in REQUIRED_METRICS + MOE_METRICS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        # vLLM (experts all-gathered over EP into its fused-MoE layout) scores the same weights as Megatron.
        assert r["rollout/logprob_diff_max"] < 1e-3
        # Both MoE layers route every token to 2 of 8 experts: some expert gets tokens, none more than all of them.
        assert 0 <= r["actor/moe_expert_load/min"] <= r["actor/moe_expert_load/max"]
        assert r["actor/moe_expert_load/max"] > 0
        assert {"actor/moe_expert_load/layer0/max", "actor/moe_expert_load/layer1/max"} <= set(r)
        assert r["actor/grad_norm"] > 0
    assert (straight_moe / "checkpoints" / "latest").read_text().strip() == "global_step_3"

    # The EP-split checkpoint exports to HF per-expert tensors that transformers loads; training moved experts.
    tensors = export(straight_moe / "checkpoints", tmp_path / "hf")
    initial = load_file(str(Path(demo_moe["hf_model"]) / "model.safetensors"))
    assert set(tensors) == set(initial)
    experts = [k for k in initial if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3
    assert any(not torch.equal(tensors[k], initial[k]) for k in experts), "training changed no expert"
    assert any(not torch.equal(tensors[k], initial[k]) for k in initial if "mlp.gate.weight" in k), "router unchanged"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_experts == 8


def test_moe_ep2_resume_continues_where_it_stopped(demo_moe, straight_moe, tmp_path):
    # The EP-split step-2 checkpoint of the straight run (its first two steps are what a 2-step run would train),
    # the later ones removed; a stopped-then-extended dense run: tests/e2e/test_train_e2e.py.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight_moe / "checkpoints" / "global_step_2", resumed / "checkpoints" / "global_step_2")
    (resumed / "checkpoints" / "latest").write_text("global_step_2\n")
    wait_ok(
        launch(
            "run_local.sh", overrides(demo_moe, resumed, steps=3, **{"trainer.val_before_train": "false"}), ENV, CONFIG
        )
    )
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [3]  # continued at 3, not restarted at 1
    assert_same_as_straight(straight_moe, resumed, (3,), tmp_path)
