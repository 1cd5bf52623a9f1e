"""PromptSampler (seeded epochs, resume) and the padding helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dapo.data import DataError, PromptSampler, collate_prompts, pad_responses


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


def test_iter_is_endless_and_matches_next_batch() -> None:
    it = iter(PromptSampler(4, 2, seed=1))
    assert [next(it) for _ in range(5)] == take(PromptSampler(4, 2, seed=1), 5)


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


def test_collate_left_pads() -> None:
    items = [
        {"input_ids": [5, 6, 7], "data_source": "a", "ground_truth": "1", "extra_info": {}, "index": 0},
        {"input_ids": [8], "data_source": "b", "ground_truth": "2", "extra_info": {"k": 1}, "index": 4},
    ]
    batch = collate_prompts(items, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["raw_prompt_ids"] == [[5, 6, 7], [8]]
    assert batch["data_source"] == ["a", "b"] and batch["index"] == [0, 4]
    assert batch["extra_info"] == [{}, {"k": 1}] and batch["ground_truth"] == ["1", "2"]
    wide = collate_prompts(items, pad_token_id=9, pad_to=5)
    assert wide["input_ids"].tolist() == [[9, 9, 5, 6, 7], [9, 9, 9, 9, 8]]
    assert wide["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]
    with pytest.raises(DataError, match="more than pad_to=2"):
        collate_prompts(items, pad_token_id=0, pad_to=2)
    with pytest.raises(DataError, match="empty batch"):
        collate_prompts([], pad_token_id=0)


def test_collate_dataset_items(tiny_tokenizer) -> None:
    from megatron_dapo.config import DataConfig
    from megatron_dapo.data import RLDataset
    from megatron_dapo.tasks.arithmetic import make_rows

    ds = RLDataset(make_rows(4, seed=0), tiny_tokenizer, DataConfig())
    batch = collate_prompts([ds[i] for i in PromptSampler(len(ds), 4, seed=0).next_batch()], 0)
    assert batch["input_ids"].shape == (4, 12)  # every arithmetic prompt is 12 tokens with the tiny tokenizer
    assert bool(batch["attention_mask"].all())
    assert batch["input_ids"][:, -1].tolist() == [8] * 4  # all end with the newline after "assistant"


def test_pad_responses() -> None:
    ids, mask = pad_responses([[4, 5], [6], []], pad_token_id=0)
    assert ids.tolist() == [[4, 5], [6, 0], [0, 0]]
    assert mask.tolist() == [[1, 1], [1, 0], [0, 0]]
    ids, mask = pad_responses([[4, 5], [6]], pad_token_id=2, max_length=4)
    assert ids.tolist() == [[4, 5, 2, 2], [6, 2, 2, 2]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    with pytest.raises(DataError, match="more than max_length=1"):
        pad_responses([[4, 5]], pad_token_id=0, max_length=1)
