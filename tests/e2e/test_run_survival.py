"""A run survives what ends runs on clusters, under torchrun on CPU with vLLM rollout:

* a task solved early (every group all-correct, so dynamic sampling cannot fill a batch) trains to its last step
  with ``on_exhausted=train`` and stops cleanly with a checkpoint with ``on_exhausted=stop``;
* a learning rate that makes the loss non-finite never applies a non-finite update: the updates are skipped, the
  run stops after ``max_consecutive_skipped_updates`` with an error naming step and quantity, and the last
  checkpoint holds only finite weights.

The task here is one the quickstart does not use: "always answer 7" (a prompt-independent target that the demo
model learns within a few steps).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.e2e.test_train_e2e import export, launch, overrides, read_metrics, wait_ok

ANSWER_7 = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == "7" else 0.0
"""
STEPS = 14


def answer7_overrides(demo: dict, out: Path, tmp_path: Path, **extra) -> list[str]:
    scorer = tmp_path / "answer7.py"
    scorer.write_text(ANSWER_7)
    items = {
        "data.train_batch_size": 4,
        "data.gen_batch_size": 4,
        "actor.ppo_mini_batch_size": 4,
        "actor.optim.lr": 3e-3,
        "reward.custom_function.path": str(scorer),
        "algorithm.filter_groups.enable": "true",
        "algorithm.filter_groups.max_num_gen_batches": 4,
        "trainer.test_freq": 7,
    }
    items.update(extra)
    return overrides(demo, out, steps=STEPS, **items)


def test_exhausted_dynamic_sampling_trains_to_the_last_step(demo, tmp_path):
    out = tmp_path / "run"
    log = wait_ok(
        launch(
            "run_local.sh",
            answer7_overrides(demo, out, tmp_path, **{"algorithm.filter_groups.on_exhausted": "train"}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29966"},
        )
    )
    rows = {r["step"]: r for r in read_metrics(out) if r["step"] > 0}
    assert sorted(rows) == list(range(1, STEPS + 1))
    last = rows[STEPS]
    assert last["critic/score/mean"] == 1.0  # learned: every sample answers 7
    assert last["train/partial_batch"] == 1.0 and last["train/num_prompts_kept"] == 0.0
    assert last["train/skipped_updates"] >= 1.0  # steps that kept nothing had no optimizer step
    assert "actor/pg_loss" not in last  # ... and no loss
    partial_trained = [r for r in rows.values() if r["train/partial_batch"] == 1.0 and "actor/pg_loss" in r]
    for r in partial_trained:  # a partial batch that kept something trained on it, with a finite loss
        assert r["actor/update_ok"] == 1.0 and math.isfinite(r["actor/pg_loss"])
    assert "dynamic sampling exhausted" in log and "on_exhausted=train" in log
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step_{STEPS}"
    assert last["val-core/arithmetic/acc/mean@1"] == 1.0  # greedy decoding answers 7 to every prompt


def test_exhausted_dynamic_sampling_stops_cleanly_with_a_checkpoint(demo, tmp_path):
    out = tmp_path / "run"
    log = wait_ok(
        launch(
            "run_local.sh",
            answer7_overrides(demo, out, tmp_path, **{"algorithm.filter_groups.on_exhausted": "stop"}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29967"},
        )
    )
    trained = [r["step"] for r in read_metrics(out) if "actor/pg_loss" in r]
    stopped_at = max(trained)
    assert stopped_at < STEPS
    assert f"stopping after step {stopped_at} of {STEPS}: dynamic sampling was exhausted" in log
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step_{stopped_at}"
    rows = read_metrics(out)
    assert rows[-1]["step"] == stopped_at and any(k.startswith("val-core/") for k in rows[-1])  # final validation
    export(out / "checkpoints", tmp_path / "hf")  # the checkpoint loads


def test_non_finite_updates_are_skipped_then_the_run_stops(demo, tmp_path):
    out = tmp_path / "run"
    proc = launch(
        "run_local.sh",
        overrides(
            demo,
            out,
            steps=8,
            **{
                "actor.optim.lr": 1e10,
                "actor.ppo_mini_batch_size": 4,  # one update per step
                "checkpoint.save_freq": 1,
                "trainer.max_consecutive_skipped_updates": 3,
            },
        ),
        {"NPROC_PER_NODE": "2", "MASTER_PORT": "29968"},
    )
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, log[-4000:]
    rows = [r for r in read_metrics(out) if "actor/update_ok" in r]
    skipped = [r for r in rows if r["actor/update_ok"] == 0.0]
    assert len(skipped) == 2  # the third skip in a row raises before its step is logged
    for r in rows:
        finite = all(math.isfinite(float(r[k])) for k in ("actor/pg_loss", "actor/grad_norm"))
        assert finite or r["actor/update_ok"] == 0.0, r  # a non-finite loss/grad norm only on a skipped step
    assert skipped[-1]["actor/num_skipped_updates"] == 2.0
    failed_step = rows[-1]["step"] + 1
    assert f"step {failed_step}: 3 consecutive updates skipped" in log and "NonFiniteUpdateError" in log
    assert log.count("update skipped, not finite") == 3
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"global_step_{failed_step - 1}"
    tensors = export(out / "checkpoints", tmp_path / "hf")
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    state = json.loads((out / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["step"] == failed_step - 1
