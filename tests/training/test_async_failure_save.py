"""The save of the last completed step after a training-side failure in async mode (``run_state.StepCheckpoints.
save_after_failure`` with ``training/async_phase.RemoteRolloutPhase`` on a real torch.distributed ``HashStore``): the
groups the failed step took from the queue are in no snapshot of the rollout ranks, so the checkpoint's
``rollout_state`` gets them back in front of the snapshot's queued groups; the groups of a completed step do not come
back. The rollout leader's side of the snapshot request is played by a thread answering as
``RolloutWorker._snapshot`` does (the queue's waiting groups as they are). The kill -9 cases run end to end in
``tests/e2e/test_async_failures.py``."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from megatron_dapo.checkpointing.checkpoint import CheckpointManager
from megatron_dapo.config import load_config
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import Placement
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.remote import Control
from megatron_dapo.training.async_phase import RemoteRolloutPhase
from megatron_dapo.training.run_state import StepCheckpoints
from tests.config.test_run_validation import TINY, TINY_HF
from tests.training.test_async_collect import N, _rows

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(monkeypatch, tmp_path) -> tuple[RemoteRolloutPhase, StepCheckpoints]:
    monkeypatch.chdir(REPO)  # tiny_cpu.yaml names its reward function relative to the repository root
    overrides = ["trainer.mode=async", "placement.rollout_ranks=1", "data.train_batch_size=2", f"rollout.n={N}"]
    overrides += ["actor.ppo_mini_batch_size=2", "data.gen_batch_size=2"]
    cfg = load_config(TINY, overrides)
    platform = make_platform("cpu")
    plan = resolve(cfg, model_arch_from_hf(TINY_HF), 2, platform, probe_imports=False)
    place = Placement("train", 0, 2, 1, 1, dist.HashStore(), None)
    phase = RemoteRolloutPhase(cfg.trainer, cfg.data, plan, place, push_weights=lambda: None, is_main=True)
    ckpt = CheckpointManager(tmp_path / "checkpoints", states=phase.checkpoint_states())
    checkpoints = StepCheckpoints(ckpt, cfg.checkpoint, cfg.trainer, {}, platform, None, lambda: None, True)
    for key in range(5):  # what the rollout ranks queue for a kept group (rollout_worker._queue_groups)
        group = {"key": key, "responses": []}
        payload = {"key": key, "batch": _rows(1.0, 0.0), "min_version": 0, "group": group, "reward_metrics": {}}
        phase.queue.put(pickle.dumps({**payload, "totals": {"gen_batches": 1, "generated": key + 1, "kept": key + 1}}))
    return phase, checkpoints


def _answer_snapshot(phase: RemoteRolloutPhase) -> threading.Thread:
    """The rollout leader: the next snapshot request answered with the data position, its buffer and the queue's
    waiting groups."""
    control = Control(phase.queue.store, 30)

    def answer() -> None:
        request = control.wait("snap/request", "the snapshot request")
        queued = [pickle.loads(p)["group"] for p in phase.queue.waiting()]
        state = {"sampler": {"epoch": 0, "position": 6}, "buffer": {"next_key": 6, "groups": []}, "queued": queued}
        control.post(f"snap/result/{request}", state)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def _saved(checkpoints: StepCheckpoints, phase: RemoteRolloutPhase, exc: BaseException, **kw: Any) -> list[dict]:
    """What the save after ``exc`` put in the checkpoint's ``rollout_state`` (one entry per save)."""
    saves: list[dict] = []

    def save() -> None:  # DAPOTrainer.save_checkpoint's rollout part, then what CheckpointManager.save stores
        phase.before_save()
        saves.append(checkpoints.ckpt.component_states()["rollout_state"])

    checkpoints.save_after_failure(exc, kw.get("step", 1), kw.get("update_in_progress", False), save)
    return saves


def test_a_failed_steps_groups_go_back_in_front_of_the_snapshot(run):
    phase, checkpoints = run
    assert [k for _, k in phase.collect(1, 0, {})[0].group_ids[::N]] == [0, 1]
    checkpoints.mark_boundary()  # step 1's update applied: its groups are trained
    assert [k for _, k in phase.collect(2, 1, {})[0].group_ids[::N]] == [2, 3]
    thread = _answer_snapshot(phase)
    saves = _saved(checkpoints, phase, RuntimeError("a training-side failure in step 2"))
    thread.join(timeout=30)
    assert len(saves) == 1
    assert [g["key"] for g in saves[0]["queued"]] == [2, 3, 4]  # step 2's groups first, then the queue's
    assert saves[0]["buffer"]["next_key"] == 6 and saves[0]["sampler"]["position"] == 6
    assert checkpoints.ckpt.component_states()["data_state"] == {"epoch": 0, "position": 6}


def test_no_save_when_the_update_was_interrupted_and_no_group_comes_back_once_the_step_completed(run):
    phase, checkpoints = run
    phase.collect(1, 0, {})
    assert _saved(checkpoints, phase, RuntimeError("in the update"), step=0, update_in_progress=True) == []
    checkpoints.mark_boundary()  # step 1 completed after all: a save of it holds none of its groups
    thread = _answer_snapshot(phase)
    saves = _saved(checkpoints, phase, RuntimeError("in validation"), step=1)
    thread.join(timeout=30)
    assert [g["key"] for g in saves[0]["queued"]] == [2, 3, 4]
