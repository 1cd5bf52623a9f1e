"""Partial rollout end to end (torchrun, 2 CPU processes, vLLM + megatron-core), through the launch scripts.

* the embedded task (configs/tiny_cpu.yaml) learns with ``rollout.partial_rollout`` in the steps synchronous
  training needs (validation >= 0.9 by step 50; sync: 1.0 by step 45-55), with stale tokens corrected (decoupled);
* a checkpoint taken while the buffer holds unfinished responses resumes to the same numbers, weights and samples as
  the uninterrupted run, and every prompt drawn is trained exactly once or still buffered: none lost, none twice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_train_e2e import assert_same_as_straight, launch, overrides, read_metrics, wait_ok

# Segments of one token over a 4-token budget: every answer (a digit, then EOS) spans at least two steps, so the
# buffer is never empty at a step boundary.
ONE_TOKEN_SEGMENTS = {"rollout.partial_rollout.enable": "true", "rollout.partial_rollout.max_segments": 4}


@pytest.mark.slow
def test_partial_rollout_learns_the_table(demo, tmp_path):
    run = tmp_path / "run"
    args = [
        f"model.hf_config_dir={demo['hf_model']}",
        f"model.tokenizer_dir={demo['tokenizer']}",
        f"checkpoint.load_dir={demo['mcore']}",
        f"data.train_files=[{demo['train']}]",
        f"data.val_files=[{demo['val']}]",
        f"trainer.output_dir={run}",
        "trainer.test_freq=10",
        # 50 of the config's 60 steps: validation reaches the bar at step 50 and stays there at step 60
        "trainer.total_training_steps=50",
        "trainer.progress_bar=false",
        "rollout.partial_rollout.enable=true",  # 2 segments of 2 tokens; off_policy.mode auto → decoupled
    ]
    wait_ok(launch("run_local.sh", args, {"NPROC_PER_NODE": "2", "MASTER_PORT": "29968"}), timeout=900)
    rows = read_metrics(run)
    val = [r["val-core/arithmetic/acc/mean@1"] for r in rows if "val-core/arithmetic/acc/mean@1" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.9, val
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert len(trained) == 50
    # Stale tokens occurred and went through the proximal forward with truncated IS weights.
    assert max(r["async/staleness/max"] for r in trained) >= 1
    stale = [r for r in trained if r["async/staleness/max"] > 0]
    assert stale and all("async/is_weight/mean" in r and "timing_s/old_log_prob" in r for r in stale)
    assert all(1 <= r["rollout/partial/segments_mean"] <= 2 for r in trained)


def _uids_by_step(dump_dir: Path) -> dict[int, list[str]]:
    out = {}
    for path in sorted(dump_dir.glob("*.jsonl")):
        out[int(path.stem)] = [json.loads(line)["uid"] for line in path.read_text().splitlines()]
    return out


def _buffer(run: Path, step: int) -> dict:
    state = json.loads((run / "checkpoints" / f"global_step_{step}" / "trainer_state.json").read_text())
    return state["rollout_buffer"]


def test_resume_with_a_non_empty_buffer_loses_and_repeats_nothing(demo, tmp_path):
    env = {"NPROC_PER_NODE": "2", "MASTER_PORT": "29970"}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = {**ONE_TOKEN_SEGMENTS, "checkpoint.save_freq": 2, "trainer.rollout_data_dir": str(straight / "dump")}
    wait_ok(launch("run_local.sh", overrides(demo, straight, steps=4, **extra), env))

    # The step-2 checkpoint holds unfinished responses (one token in, more to come).
    buffered = _buffer(straight, 2)
    unfinished = [r for g in buffered["groups"] for r in g["responses"] if not r["done"]]
    assert unfinished and all(r["segments"] >= 1 for r in unfinished)

    # Resume from step 2 (the later checkpoint removed) to step 4.
    shutil.copytree(straight / "checkpoints" / "global_step_2", resumed / "checkpoints" / "global_step_2")
    (resumed / "checkpoints" / "latest").write_text("global_step_2\n")
    extra = {**ONE_TOKEN_SEGMENTS, "checkpoint.save_freq": 2, "trainer.rollout_data_dir": str(resumed / "dump")}
    wait_ok(
        launch("run_local.sh", overrides(demo, resumed, steps=4, **extra, **{"trainer.val_before_train": "false"}), env)
    )
    assert [r["step"] for r in read_metrics(resumed) if "actor/pg_loss" in r] == [3, 4]
    assert_same_as_straight(straight, resumed, (3, 4), tmp_path)

    # The same groups, with the same responses, trained at steps 3 and 4.
    first, second = _uids_by_step(straight / "dump"), _uids_by_step(resumed / "dump")
    assert second == {3: first[3], 4: first[4]}
    for step in (3, 4):
        a = (straight / "dump" / f"{step}.jsonl").read_text()
        assert (resumed / "dump" / f"{step}.jsonl").read_text() == a

    # Every prompt drawn (group keys 0 .. next_key - 1) was trained in exactly one step or is still buffered.
    trained = [uid for step in sorted(first) for uid in dict.fromkeys(first[step])]
    final = _buffer(straight, 4)
    still = [f"g{g['key']}" for g in final["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert sorted(trained + still) == sorted(f"g{k}" for k in range(final["next_key"]))
