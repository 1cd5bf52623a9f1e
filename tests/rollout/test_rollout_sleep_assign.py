"""Pure logic of the rollout engine: sleep/wake bookkeeping by tags, and dealing prompts to replicas.

On CPU vLLM has no sleep mode, so ``RolloutEngine.sleep``/``wake_up`` never reach vLLM here; the state machine that
decides what they ask vLLM for (and whether ``generate``/``load_weights`` may run) is tested directly.
"""

from __future__ import annotations

import pytest

from megatron_dapo.rollout.engine import SleepState, assign_prompts


def test_wake_by_tags_ends_awake():
    s = SleepState()
    assert s.usable() and s.wake(["weights"]) == []  # awake: nothing to wake
    assert s.sleep() is True and s.asleep and not s.usable() and not s.usable(weights_only=True)
    assert s.sleep() is False  # already asleep: vLLM is not asked twice
    assert s.wake(["weights"]) == ["weights"]
    assert s.asleep and s.usable(weights_only=True) and not s.usable()  # a sync may run, generation may not
    assert s.wake(["weights"]) == []  # not woken twice
    assert s.wake(["kv_cache"]) == ["kv_cache"]
    assert not s.asleep and s.usable() and s.awake_tags == set()  # fully awake after the two tags
    assert s.sleep() is True  # and can sleep again


def test_wake_all_and_order():
    s = SleepState()
    s.sleep()
    assert s.wake(None) == ["weights", "kv_cache"] and not s.asleep
    s.sleep()
    assert s.wake(["kv_cache", "weights"]) == ["weights", "kv_cache"] and not s.asleep  # vLLM's order
    s.sleep()
    assert s.wake(["kv_cache"]) == ["kv_cache"] and s.asleep and not s.usable(weights_only=True)
    assert s.wake(None) == ["weights"] and not s.asleep  # only what is still asleep
    with pytest.raises(ValueError, match=r"wake_up tags \['kv'\]"):
        s.wake(["kv"])


@pytest.mark.parametrize("n", [0, 1, 5, 7, 16, 33])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_assign_prompts_balanced_partition(n, replicas):
    lengths = [(i * 37) % 101 + 1 for i in range(n)]
    shares = assign_prompts(lengths, replicas)
    assert len(shares) == replicas
    assert sorted(i for s in shares for i in s) == list(range(n))  # every prompt exactly once
    assert all(s == sorted(s) for s in shares)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    assert assign_prompts(lengths, replicas) == shares  # deterministic (every rank computes it)


def test_assign_prompts_spreads_long_and_short():
    # Sorted by length, a contiguous split would give replica 0 all the long prompts.
    lengths = [100, 90, 80, 70, 10, 9, 8, 7]
    shares = assign_prompts(lengths, 2)
    assert shares == [[0, 3, 4, 7], [1, 2, 5, 6]]  # snake order: 100,70,10,7 | 90,80,9,8
    tokens = [sum(lengths[i] for i in s) for s in shares]
    assert tokens == [187, 187]
    # Ties keep index order.
    assert assign_prompts([5, 5, 5, 5, 5], 2) == [[0, 3, 4], [1, 2]]
    with pytest.raises(ValueError):
        assign_prompts([1], 0)
