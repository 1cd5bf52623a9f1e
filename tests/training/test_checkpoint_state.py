"""The trainer's checkpointed state without a model or process group: the run's counters (``RunCounters``, the
``trainer`` component) through JSON, ``CheckpointManager``'s registration and the in-place restore of registered
components (what ``load`` and the trainer's failure save use). The save/load of these states with a real checkpoint
is in ``test_checkpoint.py``; a resumed adaptive-KL run in ``tests/e2e/test_resume_kl_e2e.py``.
"""

from __future__ import annotations

import json

import pytest

from megatron_dapo.algo.kl import AdaptiveKLController
from megatron_dapo.checkpointing.checkpoint import CheckpointManager
from megatron_dapo.data import PromptSampler
from megatron_dapo.training.run_state import RunCounters


def bare_trainer(**counters: int) -> RunCounters:
    """The trainer's run counters, what it registers as the ``trainer`` component."""
    return RunCounters(**counters)


def test_trainer_counters_round_trip() -> None:
    counts = {
        "num_skipped_updates": 4,
        "consecutive_skipped_updates": 1,
        "num_partial_batches": 2,
        "num_empty_steps": 3,
    }
    state = json.loads(json.dumps(bare_trainer(**counts).state_dict()))
    assert state == counts
    resumed = bare_trainer()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == counts
    # A state written before a counter existed leaves it as the trainer has it.
    partial = bare_trainer(num_empty_steps=7)
    partial.load_state_dict({"num_skipped_updates": 5})
    assert partial.state_dict() == {
        "num_skipped_updates": 5,
        "consecutive_skipped_updates": 0,
        "num_partial_batches": 0,
        "num_empty_steps": 7,
    }


def test_registration_and_in_place_restore(tmp_path) -> None:
    trainer, kl, sampler = bare_trainer(num_partial_batches=2), AdaptiveKLController(0.01, 0.1, 50), PromptSampler(8, 2)
    manager = CheckpointManager(tmp_path, states={"trainer": trainer, "kl_ctrl": kl, "data_state": sampler})
    with pytest.raises(ValueError, match="'kl_ctrl'.*registered already"):
        manager.register("kl_ctrl", kl)
    with pytest.raises(ValueError, match="'step'.*reserved by trainer_state.json"):
        manager.register("step", kl)

    kl.update(0.5, 16)
    sampler.next_batch()
    boundary = json.loads(json.dumps(manager.component_states()))  # a step boundary, as trainer_state.json has it
    assert boundary["kl_ctrl"] == {"type": "adaptive", "value": kl.value}
    # The next step moves every component; restoring the boundary brings each back.
    kl.update(0.5, 16)
    sampler.next_batch()
    trainer.num_partial_batches += 1
    assert manager.load_component_states(boundary) == []
    assert manager.component_states() == boundary
    # Entries an older checkpoint lacks (or holds as null) are reported and leave those components as they are.
    kl.update(0.5, 16)
    moved = kl.value
    assert manager.load_component_states({"data_state": None, "trainer": {}}) == ["kl_ctrl", "data_state"]
    assert kl.value == moved and sampler.position == 1 and trainer.num_partial_batches == 2


def test_async_rollout_state_and_the_data_position_across_modes(tmp_path) -> None:
    """trainer.mode=async keeps the rollout ranks' snapshot as ``rollout_state`` and its data position as
    ``data_state``: an async run resumes a synchronous run's checkpoint at its data position, and a synchronous run
    an async one's."""
    from megatron_dapo.training.async_phase import DataPosition, RolloutState

    def async_manager() -> tuple[CheckpointManager, RolloutState]:
        state = RolloutState()
        return CheckpointManager(tmp_path, states={"rollout_state": state, "data_state": DataPosition(state)}), state

    sync_sampler = PromptSampler(8, 2)
    sync_sampler.next_batch()
    from_sync = json.loads(json.dumps({"data_state": sync_sampler.state_dict()}))
    manager, state = async_manager()
    assert manager.load_component_states(from_sync) == ["rollout_state"]
    assert state.restored == {
        "sampler": sync_sampler.state_dict(),
        "buffer": {"next_key": 0, "groups": []},
        "queued": [],
    }

    snapshot = {"sampler": {**sync_sampler.state_dict(), "position": 3}, "buffer": {"next_key": 9, "groups": []}}
    snapshot["queued"] = [{"key": 7, "item": 2, "prompt": [5], "responses": []}]
    manager, state = async_manager()
    state.latest = snapshot  # what before_save received from the rollout ranks
    saved = json.loads(json.dumps(manager.component_states()))
    assert saved == {"rollout_state": snapshot, "data_state": snapshot["sampler"]}
    manager, state = async_manager()
    assert manager.load_component_states(saved) == [] and state.restored == snapshot
    resumed_sync = PromptSampler(8, 2)
    resumed_sync.load_state_dict(saved["data_state"])
    assert resumed_sync.position == 3
    # Before any snapshot (nothing generated yet) there is no data position to save: null, restored as nothing.
    manager, state = async_manager()
    assert manager.component_states() == {"rollout_state": {}, "data_state": None}


class _RecordingManager:
    """Stands in for ``CheckpointManager``: records how saves are asked for and when pending ones are finalised."""

    def __init__(self, save_dir) -> None:
        self.save_dir, self.calls, self.pending_step = save_dir, [], None

    def component_states(self) -> dict:
        return {}

    def load_component_states(self, states) -> list:
        return []

    def save(self, step: int, blocking: bool = True, **kwargs) -> None:
        self.calls.append(("save", step, blocking))
        self.pending_step = None if blocking else step

    def finalize(self) -> None:
        self.calls.append(("finalize", self.pending_step))
        self.pending_step = None


def test_step_checkpoints_background_saves_are_finished(tmp_path) -> None:
    """``StepCheckpoints(background=True)``: saves do not block; ``finish_saves`` (before exit), a resume and the
    failure handler (even when it saves nothing new) publish a pending save first."""
    from types import SimpleNamespace

    from megatron_dapo.config import load_config, to_dict
    from megatron_dapo.training.failure import NonFiniteUpdateError
    from megatron_dapo.training.run_state import StepCheckpoints

    cfg = load_config(None, ["parallel.platform=cpu", f"checkpoint.save_dir={tmp_path}"])
    handoff = SimpleNamespace(before_save=lambda engine: None, after_save=lambda: None)
    platform = SimpleNamespace(rng_state=lambda: {}, set_rng_state=lambda state: None)
    manager = _RecordingManager(tmp_path)
    run_config = to_dict(cfg)
    steps = StepCheckpoints(
        manager, cfg.checkpoint, cfg.trainer, run_config, platform, handoff, lambda: None, is_main=True, background=True
    )
    actor = SimpleNamespace(chunks=[], optimizer=None)
    steps.save(3, actor, scheduler=None, engine=None)
    assert manager.calls == [("save", 3, False)] and steps.saved_step == 3 and not steps.saving
    steps.finish_saves()
    assert manager.calls[-1] == ("finalize", 3) and manager.pending_step is None
    assert steps.resume(actor, scheduler=None) is None  # nothing to resume from in an empty save_dir
    assert manager.calls[-1] == ("finalize", None)  # ``latest`` is read after any pending save is published
    # A failure after a background save of the last completed step: nothing new to save, the pending one published.
    steps.save(4, actor, scheduler=None, engine=None)
    steps.save_after_failure(NonFiniteUpdateError("boom"), 4, update_in_progress=False, save=lambda: None)
    assert manager.calls[-2:] == [("save", 4, False), ("finalize", 4)]
