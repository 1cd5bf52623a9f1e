"""Async mode keeps its work across rank deaths (trainer.mode=async, docs/async.md): one torchrun job of 2 CPU
processes (1 training rank, 1 vLLM rollout rank) with ``MAX_RESTARTS=4``, so one launch covers a kill -9 of each side
mid-step and mid-save, and every resume (``checkpoint.resume_mode=auto``, save_freq=2, 4 steps):

* attempt 0: the rollout rank is killed mid-step, once step 2 is published (the trainer is in step 3 or 4). The
  trainer notices the dead rank while it waits for groups or for the snapshot of a save after the failure: with no
  snapshot to be had it publishes nothing, and step 2 stays ``latest``;
* attempt 1: resumed from step 2, the training rank is killed in the middle of step 3's update. The rollout rank
  notices and ends; step 2 stays ``latest``;
* attempt 2: resumed from step 2, the rollout rank is killed while it builds its snapshot for the save of step 4. The
  trainer has no snapshot, so it publishes nothing; step 2 stays ``latest``;
* attempt 3: resumed from step 2, the training rank is killed in the middle of saving step 4 (every file written, the
  step directory not yet published). The rollout rank notices and ends; step 2 stays ``latest``;
* attempt 4: resumed from step 2 again, finishes step 4.

Checked: the first error line of each death names the dead rank; every drawn group key is trained exactly once in the
surviving lineage (the rollout dump of each step, rewritten by the attempt that trained it last) or waits in the final
checkpoint's rollout snapshot; every attempt's metrics rows continue from the step it resumed. The save of the last
completed step after a training-side exception, with the failed step's groups put back, is tested at unit level in
``tests/training/test_async_failure_save.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.e2e.test_train_e2e import launch, leftover_processes, overrides, read_metrics, wait_ok

ASYNC = {"trainer.mode": "async", "placement.rollout_ranks": 1, "trainer.progress_bar": "false"}

# The rollout rank scores the groups (reward.num_workers=0: in its own process). In attempt 0 it dies at the first
# call after step 2 is published.
KILLING_SCORER = """
import os, signal
from pathlib import Path
from megatron_dapo.tasks.arithmetic import compute_score as _score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and Path({latest!r}).exists():
        Path({mark!r}).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return _score(data_source, solution_str, ground_truth, extra_info)
"""

# Imported by every rank (algorithm.user_algorithms_file): in attempt 1 the training rank dies in its first update
# (step 3's); in attempt 2 the rollout rank dies while it builds the snapshot of a save (step 4's); in attempt 3 the
# training rank dies when the save of step 4 has written everything and is about to publish it
# (checkpointing/checkpoint.py renames .tmp-step_4 last).
KILLING_HOOKS = """
import os, signal
from pathlib import Path
import megatron_dapo.checkpointing.checkpoint as checkpoint
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.training.rollout_worker import RolloutWorker

def _attempt():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))

def _die(mark, text):
    Path(mark).write_text(text)
    os.kill(os.getpid(), signal.SIGKILL)

_update, _snapshot, _publish = MegatronActor.update, RolloutWorker._snapshot, checkpoint.publish_dir

def _update_or_die(self, *args, **kwargs):
    if _attempt() == 1:
        _die({update_mark!r}, str(os.getpid()))
    return _update(self, *args, **kwargs)

def _snapshot_or_die(self, request):
    if _attempt() == 2:
        _die({snapshot_mark!r}, str(os.getpid()))
    return _snapshot(self, request)

def _publish_or_die(tmp, final, **kwargs):
    if _attempt() == 3 and final.name == "global_step_4":
        _die({save_mark!r}, str(sorted(p.name for p in Path(tmp).rglob("*"))))
    return _publish(tmp, final, **kwargs)

MegatronActor.update, RolloutWorker._snapshot = _update_or_die, _snapshot_or_die
checkpoint.publish_dir = _publish_or_die
"""


def _uids(dump: Path) -> dict[int, list[str]]:
    """Each step's groups in the rollout dump, in order, once each."""
    return {
        int(p.stem): list(dict.fromkeys(json.loads(x)["uid"] for x in p.read_text().splitlines()))
        for p in dump.glob("*.jsonl")
    }


def _runs(steps: list[int]) -> list[list[int]]:
    """The metrics rows' steps cut where a step does not follow the previous one (a resume)."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def test_kill_9_of_each_side_mid_step_and_mid_save_each_resumed(demo, tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    marks = {k: tmp_path / k for k in ("rollout_mid_step", "trainer_mid_update", "rollout_mid_snapshot", "save")}
    scorer = tmp_path / "scorer.py"
    scorer.write_text(KILLING_SCORER.format(latest=str(ckpts / "latest"), mark=str(marks["rollout_mid_step"])))
    algorithms = tmp_path / "kill_hooks.py"
    algorithms.write_text(
        KILLING_HOOKS.format(
            update_mark=str(marks["trainer_mid_update"]),
            snapshot_mark=str(marks["rollout_mid_snapshot"]),
            save_mark=str(marks["save"]),
        )
    )
    extra = {
        **ASYNC,
        "checkpoint.save_freq": 2,
        "reward.custom_function.path": scorer,
        "reward.num_workers": 0,
        "algorithm.user_algorithms_file": algorithms,
        "trainer.rollout_data_dir": run / "dump",
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
    }
    env = {"NPROC_PER_NODE": "2", "MASTER_PORT": "29370", "MAX_RESTARTS": "4"}
    out = wait_ok(launch("run_local.sh", overrides(demo, run, steps=4, **extra), env), timeout=900)
    assert all(mark.exists() for mark in marks.values()), ([m.name for m in marks.values() if m.exists()], out[-4000:])
    written = marks["save"].read_text()  # what the killed save had written: all of it, unpublished
    assert "trainer_state.json" in written and "manifest" in written, written

    # Each death is named first by the survivor, in order: rollout, training, rollout, training (attempts 0-3).
    deaths = re.findall(r"rank (\d) \((training|rollout)[^)]*\) died: its process \(pid (\d+)\) is gone", out)
    named = list(dict.fromkeys(deaths))  # a death once, where it was first named
    roles = [("1", "rollout"), ("0", "training"), ("1", "rollout"), ("0", "training")]
    assert [(rank, role) for rank, role, _ in named] == roles, out[-8000:]
    pids = [marks[k].read_text() for k in ("rollout_mid_step", "trainer_mid_update", "rollout_mid_snapshot")]
    assert [pid for _, _, pid in named[:3]] == pids, (named, pids)

    # Every resume starts from step 2: a failure mid-step or mid-snapshot had no snapshot to save, and the killed
    # save published nothing (latest stayed global_step_2).
    rank0 = (run / "logs" / "rank0.log").read_text()  # every attempt appends to it
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", rank0)
    assert [(Path(d).name, s) for d, s in resumed] == [("global_step_2", "2")] * 4, rank0[-4000:]
    assert (ckpts / "latest").read_text().strip() == "global_step_4"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("global_step_")) == [
        "global_step_2",
        "global_step_4",
    ]
    assert not leftover_processes(run), "the restarted run left processes behind"

    # Metrics: attempt 0 logged steps 1-2 (and 3 if it finished it), attempt 1 none (it died in step 3's update),
    # attempts 2 and 3 step 3 and perhaps 4 (they died in its save), attempt 4 steps 3-4: every run of rows starts at
    # step 1 or right after the resumed step 2, and the last one ends the run.
    steps = [r["step"] for r in read_metrics(run) if "actor/pg_loss" in r]
    runs = _runs(steps)
    assert runs[0][:2] == [1, 2] and all(r[0] == 3 for r in runs[1:]), steps
    assert runs[-1] == [3, 4] and 2 <= len(runs) <= 4, steps

    # Groups: the dump of a step is the last attempt's that trained it, i.e. the surviving lineage's (steps 1-2 of
    # attempt 0, 3-4 of attempt 4). Each drawn key is trained once there or waits in the final snapshot.
    uids = _uids(run / "dump")
    assert sorted(uids) == [1, 2, 3, 4]
    trained = [uid for step in sorted(uids) for uid in uids[step]]
    assert all(len(uids[s]) == 4 for s in uids)  # data.train_batch_size groups per step
    final = json.loads((ckpts / "global_step_4" / "trainer_state.json").read_text())["rollout_state"]
    waiting = [f"g{g['key']}" for g in final["queued"] + final["buffer"]["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & set(waiting)
    assert sorted(trained + waiting) == sorted(f"g{k}" for k in range(final["buffer"]["next_key"]))
