"""Dynamic sampling in async mode is capped per trained batch as in sync mode (algo/dynamic_sampling.py): 1 training
rank + 1 rollout rank, ``data.train_batch_size = data.gen_batch_size = 4`` groups of 8 responses.

The reward runs on the rollout rank (``reward.num_workers=0``: in its process) and alternates 0/1 over its first 64
calls, so the first 8 groups scored are mixed, then is 0 for good: every later group is all-equal, as on a solved task.
So steps 1 and 2 each cost one generation batch of 4 kept groups, and every later batch finds nothing:

* ``on_exhausted=train``: every later step stops at ``max_num_gen_batches`` generation batches and trains on filler
  (dropped groups, loss mask zero: no update), and the run finishes all its steps;
* ``on_exhausted=stop``: the run stops after step 2 with sync mode's message and a checkpoint of step 2.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_async_e2e import ASYNC
from tests.e2e.test_train_e2e import launch, overrides, read_metrics, wait_ok

MIXED_THEN_EQUAL = """
_calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global _calls
    _calls += 1
    return float(_calls % 2) if _calls <= 64 else 0.0
"""
CAP = 2
STEPS = 4


def _run(demo: dict, tmp_path: Path, on_exhausted: str, port: str) -> tuple[str, Path]:
    scorer = tmp_path / "mixed_then_equal.py"
    scorer.write_text(MIXED_THEN_EQUAL)
    run = tmp_path / "run"
    extra = {
        **ASYNC,
        "data.train_batch_size": 4,
        "data.gen_batch_size": 4,
        "reward.custom_function.path": str(scorer),
        "reward.num_workers": 0,
        "algorithm.filter_groups.enable": "true",
        "algorithm.filter_groups.max_num_gen_batches": CAP,
        "algorithm.filter_groups.on_exhausted": on_exhausted,
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
    }
    log = wait_ok(launch("run_local.sh", overrides(demo, run, steps=STEPS, **extra), {"NPROC_PER_NODE": "2", **port}))
    return log, run


def test_exhausted_batches_train_on_filler_within_the_cap_to_the_last_step(demo, tmp_path):
    log, run = _run(demo, tmp_path, "train", {"MASTER_PORT": "29954"})
    rows = {r["step"]: r for r in read_metrics(run) if "train/num_gen_batches" in r}
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step in (1, 2):
        r = rows[step]
        assert (r["train/num_gen_batches"], r["train/num_prompts_generated"], r["train/num_prompts_kept"]) == (1, 4, 4)
        assert r["train/partial_batch"] == 0.0 and r["train/kept_prompt_ratio"] == 1.0 and "actor/pg_loss" in r
    for step in range(3, STEPS + 1):
        r = rows[step]
        assert r["train/num_gen_batches"] == CAP and r["train/num_prompts_generated"] == 4 * CAP
        assert r["train/num_prompts_kept"] == 0 and r["train/kept_prompt_ratio"] == 0.0
        assert r["train/partial_batch"] == 1.0 and "actor/pg_loss" not in r  # filler only: no loss, no update
    assert rows[STEPS]["train/skipped_updates"] == STEPS - 2
    assert all(r["async/dropped_stale_groups"] == 0 for r in rows.values())
    message = "dynamic sampling exhausted after 2 generation batches with 0 of 4 prompts kept; training on those"
    assert log.count(message) == STEPS - 2 and "on_exhausted=train): none, so the update is skipped" in log
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step_{STEPS}"


def test_exhausted_batch_stops_the_run_as_in_sync_mode(demo, tmp_path):
    log, run = _run(demo, tmp_path, "stop", {"MASTER_PORT": "29956"})
    trained = [r["step"] for r in read_metrics(run) if "actor/pg_loss" in r]
    assert trained == [1, 2]
    assert f"stopping after step 2 of {STEPS}: dynamic sampling was exhausted" in log
    assert "(algorithm.filter_groups.on_exhausted=stop)" in log
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_2"
