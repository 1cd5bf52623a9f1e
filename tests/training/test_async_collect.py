"""The training side of async dynamic sampling (``training/async_phase.RemoteRolloutPhase.collect``) on a real
torch.distributed store (``HashStore``), fed the payloads the rollout ranks queue (``training/rollout_worker.py``:
kept groups and filler with their window's totals from ``algo/dynamic_sampling.TrainedBatchWindow``, or an exhausted
message). The whole exchange runs in ``tests/e2e/test_async_dynamic_sampling.py``; here each ``on_exhausted`` case,
``error`` included, with its numbers."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.algo.dynamic_sampling import TrainedBatchWindow
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import Placement
from megatron_dapo.platform import make_platform
from megatron_dapo.training.async_phase import RemoteRolloutPhase
from tests.config.test_run_validation import TINY, TINY_HF

REPO = Path(__file__).resolve().parents[2]
N = 2  # responses per group


@pytest.fixture
def phase(monkeypatch) -> RemoteRolloutPhase:
    monkeypatch.chdir(REPO)  # tiny_cpu.yaml names its reward function relative to the repository root
    overrides = ["trainer.mode=async", "placement.rollout_ranks=1", "data.train_batch_size=2", f"rollout.n={N}"]
    overrides += ["actor.ppo_mini_batch_size=2", "data.gen_batch_size=2"]
    cfg = load_config(TINY, overrides)
    plan = resolve(cfg, model_arch_from_hf(TINY_HF), 2, make_platform("cpu"), probe_imports=False)
    place = Placement("train", 0, 2, 1, 1, dist.HashStore(), None)
    return RemoteRolloutPhase(cfg.trainer, cfg.data, plan, place, push_weights=lambda: None, is_main=True)


def _rows(reward: float, first: float) -> TrainBatch:
    """A group's N rows: one-token prompts and two-token responses, every response token in the loss."""
    return TrainBatch(
        prompts=torch.ones(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1, dtype=torch.long),
        responses=torch.ones(N, 2, dtype=torch.long),
        response_mask=torch.ones(N, 2, dtype=torch.long),
        token_level_scores=torch.tensor([[0.0, first], [0.0, reward]]),
    )


def _queue(phase: RemoteRolloutPhase, window: TrainedBatchWindow, key: int, rewards: tuple[float, float]) -> None:
    """What the rollout ranks queue for one scored group: itself when kept, and filler when the window is exhausted
    (on_exhausted=train)."""
    rows = _rows(rewards[1], rewards[0])
    if window.add(rows, (key, 0), torch.tensor(rewards)):
        group = {"key": key, "batch": rows, "min_version": 0, "group": {"responses": []}}
        _put(phase, window, {**group, "reward_metrics": {"reward/score": rewards[0]}})
    if window.exhausted:
        filler, ids = window.take_filler()
        for i in range(0, len(ids), N):
            filler_rows = filler.select(range(i, i + N))
            _put(phase, window, {"key": ids[i][0], "batch": filler_rows, "min_version": 0, "filler": True})


def _put(phase: RemoteRolloutPhase, window: TrainedBatchWindow, payload: dict) -> None:
    phase.queue.put(pickle.dumps({**payload, "totals": dict(window.totals)}))


def test_a_full_batch_then_an_exhausted_one_filled_with_dropped_groups(phase):
    window = TrainedBatchWindow(train_batch_size=2, n=N, gen_batch_size=2, enable=True, max_num_gen_batches=2)
    for key, rewards in enumerate([(1.0, 0.0), (1.0, 1.0), (0.0, 1.0)]):  # kept, dropped, kept: batch 1 is full
        _queue(phase, window, key, rewards)
    for key, rewards in enumerate([(0.0, 1.0), (1.0, 1.0), (0.0, 0.0), (1.0, 1.0)], start=3):  # 1 kept of 4
        _queue(phase, window, key, rewards)
    batch, metrics = phase.collect(1, 0, {})
    assert [key for _, key in batch.group_ids] == [0, 0, 2, 2] and not batch.filler.any()
    assert bool(batch.loss_mask.all()) and metrics["train/partial_batch"] == 0.0
    assert (metrics["train/num_gen_batches"], metrics["train/num_prompts_generated"]) == (2, 3)
    assert metrics["train/num_prompts_kept"] == 2 and metrics["train/kept_prompt_ratio"] == pytest.approx(2 / 3)
    assert metrics["reward/score"] == 0.5  # the mean over the kept groups' rounds: 1.0 and 0.0

    batch, metrics = phase.collect(2, 0, {})
    # group 3 was kept; group 4, the first dropped one, fills the batch with its loss mask zero
    assert [key for _, key in batch.group_ids] == [3, 3, 4, 4]
    assert batch.filler.tolist() == [False, False, True, True]
    assert batch.loss_mask.tolist() == [[1, 1], [1, 1], [0, 0], [0, 0]]
    assert (metrics["train/num_gen_batches"], metrics["train/num_prompts_generated"]) == (2, 4)
    assert metrics["train/num_prompts_kept"] == 1 and metrics["train/kept_prompt_ratio"] == 0.25
    assert metrics["train/partial_batch"] == 1.0 and metrics["reward/score"] == 0.0  # only the kept group's


@pytest.mark.parametrize("error", [False, True])
def test_an_exhausted_message_stops_or_raises_with_the_synchronous_message(phase, error):
    window = TrainedBatchWindow(train_batch_size=2, n=N, gen_batch_size=2, enable=True, max_num_gen_batches=1)
    _queue(phase, window, 0, (0.0, 1.0))  # kept
    _queue(phase, window, 1, (0.0, 1.0))  # kept: batch 1 is full
    for key in (2, 3):  # one generation batch of two dropped groups: the second batch is exhausted
        assert window.add(_rows(1.0, 1.0), (key, 0), torch.tensor([1.0, 1.0])) is False
    assert window.exhausted
    message = window.close()
    _put(phase, window, {"exhausted": message, "error": error})
    assert phase.collect(1, 0, {})[1]["train/num_prompts_kept"] == 2
    if error:
        with pytest.raises(RuntimeError) as info:
            phase.collect(2, 0, {})
        assert str(info.value) == message
        assert message.startswith("dynamic sampling kept 0 of 2 generated prompts (4 trajectories) after 1 generation")
    else:
        assert phase.collect(2, 0, {}) is None
