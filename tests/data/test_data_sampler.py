"""PromptSampler (seeded epochs, resume) and the padding helpers."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_dapo.data import DataError, PromptSampler


def take(sampler: PromptSampler, k: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(k)]


def test_epochs_are_seeded_permutations() -> None:
    sampler = PromptSampler(10, 3, shuffle=True, seed=7)
    assert len(sampler) == 3  # 10 // 3 with drop_last
    epoch0 = take(sampler, 3)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0
    epoch1 = take(sampler, 3)
    order0 = np.random.default_rng(7).permutation(10).tolist()
    order1 = np.random.default_rng(8).permutation(10).tolist()
    assert epoch0 == [order0[0:3], order0[3:6], order0[6:9]]
    assert epoch1 == [order1[0:3], order1[3:6], order1[6:9]]
    assert epoch0 != epoch1
    assert take(PromptSampler(10, 3, shuffle=True, seed=7), 6) == epoch0 + epoch1  # same seed, same batches


def test_no_shuffle_and_keep_last() -> None:
    sampler = PromptSampler(5, 2, shuffle=False, drop_last=False)
    assert len(sampler) == 3
    assert take(sampler, 4) == [[0, 1], [2, 3], [4], [0, 1]]
    assert sampler.epoch == 1


@pytest.mark.parametrize("k", [0, 2, 3, 5])
def test_resume_continues_with_the_next_batch(k: int) -> None:
    reference = PromptSampler(10, 3, seed=11)
    expected = take(reference, k + 4)[k:]
    interrupted = PromptSampler(10, 3, seed=11)
    take(interrupted, k)
    state = interrupted.state_dict()
    assert set(state) >= {"epoch", "position", "seed", "dataset_len", "batch_size"}
    resumed = PromptSampler(10, 3, seed=11)
    resumed.load_state_dict(dict(state))
    assert take(resumed, 4) == expected


def test_resume_checks_setup() -> None:
    state = PromptSampler(10, 3, seed=11).state_dict()
    with pytest.raises(DataError, match="taken with dataset_len=10 but this run has dataset_len=12"):
        PromptSampler(12, 3, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match="no 'position'"):
        PromptSampler(10, 3, seed=11).load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="invalid position"):
        PromptSampler(10, 3, seed=11).load_state_dict({**state, "position": 3})


def test_sampler_argument_errors() -> None:
    with pytest.raises(DataError, match="larger than the dataset"):
        PromptSampler(3, 4)
    with pytest.raises(DataError, match="batch_size must be positive"):
        PromptSampler(3, 0)
    assert PromptSampler(3, 4, drop_last=False).next_batch() != []
