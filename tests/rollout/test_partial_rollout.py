"""Partial rollout's bookkeeping (``rollout/partial.py``, ``training/group_sources.PartialGroups``), pure.

The engine here is a scripted stand-in with the engine's request-level API (``generate_segments``), so segment
sizes, stop and budget handling, versions, hand-over order and the checkpoint round trip are checked on exact,
hand-worked cases. That a split generation is token-for-token the uninterrupted one, and that every token's
log-prob belongs to the version it records, is checked with the real vLLM engine and Megatron recompute in
``tests/rollout/dist_worker.py`` (``split_*``, ``partial_v*``).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.config.plan import PartialPlan
from megatron_dapo.data import PromptSampler
from megatron_dapo.rollout.partial import PartialRollout, groups_to_rollout
from megatron_dapo.rollout.types import SamplingSpec, Segment
from megatron_dapo.training.group_sources import PartialGroups, PromptData

STOP = 1
SPEC = SamplingSpec(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=10, stop_token_ids=(STOP,))


class ScriptedEngine:
    """A response to prompt ``[L, ...]`` is ``100, 101, ...`` and ends with the stop token as its ``L``-th token;
    the log-prob of a token is ``-token / 1000``. Records every call's requests."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.calls: list[list] = []

    def generate_segments(self, requests, sampling, seed_offset=0):
        self.calls.append(list(requests))
        out = []
        for req in requests:
            target = req.token_ids[0]
            done_so_far = len(req.token_ids) - self.prompt_len
            tokens = []
            for pos in range(done_so_far, done_so_far + req.max_tokens):
                tokens.append(STOP if pos + 1 == target else 100 + pos)
                if tokens[-1] == STOP:
                    break
            out.append(Segment(tokens, [-t / 1000 for t in tokens], hit_budget=tokens[-1] != STOP))
        return out

    prompt_len = 2  # every prompt here has two tokens: [target length, 7]


def test_segments_stop_budget_and_versions():
    # Budget 10 in segments of 3, at most 3 segments: the third takes the rest (4). Targets: 2 (ends in the first
    # segment), 5 (second), 20 (never stops: truncated at 10 after 3 + 3 + 4).
    engine = ScriptedEngine()
    buf = PartialRollout(engine, PartialPlan(segment_length=3, max_segments=3), max_response_length=10)
    buf.add([0, 1, 2], [[2, 7], [5, 7], [20, 7]], n=1)
    for step in range(3):
        assert buf.pending(step, again=False)  # every unfinished response advances once per step
        buf.advance(buf.pending(step), step, version=10 + step, sampling=SPEC, seed_offset=0)
        assert buf.pending(step) == []  # advanced this step already
    assert [[r.max_tokens for r in call] for call in engine.calls] == [[3, 3, 3], [3, 3], [4]]
    # The continuation resubmits prompt + tokens so far, as ids, with a seed key (group, sample, segment).
    assert engine.calls[1][0].token_ids == (5, 7, 100, 101, 102) and engine.calls[1][0].seed_key == (1, 0, 1)
    short, mid, long = (g.responses[0] for g in buf.groups)
    assert (short.tokens, short.versions, short.segments, short.truncated) == ([100, STOP], [10, 10], 1, False)
    assert (mid.tokens, mid.versions, mid.truncated) == ([100, 101, 102, 103, STOP], [10] * 3 + [11] * 2, False)
    assert long.tokens == list(range(100, 110)) and long.versions == [10] * 3 + [11] * 3 + [12] * 4
    assert long.truncated and long.segments == 3 and long.done
    assert long.log_probs == [-t / 1000 for t in long.tokens]

    batch = groups_to_rollout(buf.take_done(5), pad_token_id=0)
    assert buf.groups == []
    assert batch.response_lengths.tolist() == [2, 5, 10] and batch.truncated.tolist() == [False, False, True]
    assert batch.token_versions[1].tolist() == [10, 10, 10, 11, 11, 0, 0, 0, 0, 0]
    assert torch.equal(batch.rollout_log_probs[2], torch.tensor([-t / 1000 for t in range(100, 110)]))


def test_take_done_oldest_first_and_groups_whole():
    engine = ScriptedEngine()
    buf = PartialRollout(engine, PartialPlan(segment_length=2, max_segments=5), max_response_length=10)
    buf.add([0, 1, 2, 3], [[2, 7], [9, 7], [2, 7], [1, 7]], n=2)  # group 1 needs 5 segments
    buf.advance(buf.pending(0), 0, 0, SPEC, 0)
    assert buf.num_done() == 3 and buf.num_in_flight() == 1 and buf.buffered_responses() == 2
    first = buf.take_done(2)
    assert [g.key for g in first] == [0, 2]  # oldest first, the unfinished group 1 skipped, the limit respected
    assert [g.key for g in buf.take_done(9)] == [3]
    assert [g.key for g in buf.groups] == [1]


def test_checkpoint_round_trip_continues_identically():
    def run(split_at: int) -> list:
        engine = ScriptedEngine()
        buf = PartialRollout(engine, PartialPlan(segment_length=2, max_segments=4), max_response_length=8)
        buf.add([5, 6], [[3, 7], [30, 7]], n=2)
        for step in range(4):
            if step == split_at:  # a checkpoint through JSON (trainer_state.json), restored into a new buffer
                state = json.loads(json.dumps(buf.state_dict()))
                buf = PartialRollout(engine, buf.plan, 8)
                buf.load_state_dict(state)
            buf.advance(buf.pending(step), step, step, SPEC, 0)
        return [(g.key, g.item, r.tokens, r.log_probs, r.versions) for g in buf.groups for r in g.responses]

    assert run(split_at=2) == run(split_at=-1)


def _source(engine: ScriptedEngine, targets: list[int], gen_batch: int, n: int = 1) -> PartialGroups:
    rows = [{"input_ids": [t, 7]} for t in targets]
    data = PromptData(train=rows, val=None, sampler=PromptSampler(len(rows), gen_batch, shuffle=False))
    return PartialGroups(engine, data, SPEC, PartialPlan(2, 3), max_response_length=6, n=n)


def test_rounds_draw_only_what_the_batch_needs():
    # Prompts of targets 2 (done in one segment) and 9 (truncated after 3 segments: 2 + 2 + 2).
    engine = ScriptedEngine()
    src = _source(engine, [2, 9, 2, 9, 2, 9, 2, 9], gen_batch=4)
    rollout, items, ids, _ = src.round(step=1, version=0, need=2, index=0)
    assert [it["input_ids"][0] for it in items] == [2, 2] and len(ids) == 2
    assert src.buffer.num_in_flight() == 2 and src.buffer.next_key == 4  # one generation batch drawn
    # The next step: the two long groups advance once; nothing is drawn, since they could fill the need of 2.
    assert src.round(step=2, version=1, need=2, index=0) is None
    assert src.buffer.next_key == 4 and [len(c) for c in engine.calls] == [4, 2]
    # Nothing left to advance in step 2 and the batch still needs 2: a new generation batch is drawn.
    rollout, items, _, _ = src.round(step=2, version=1, need=2, index=1)
    assert src.buffer.next_key == 8 and [it["input_ids"][0] for it in items] == [2, 2]
    # Step 3: the first two long groups reach their third (last) segment and are handed over, truncated, with
    # tokens of versions 0, 1 and 2.
    rollout, items, _, _ = src.round(step=3, version=2, need=2, index=0)
    assert rollout.truncated.tolist() == [True, True]
    assert rollout.token_versions[0].tolist() == [0, 0, 1, 1, 2, 2]
    metrics = src.metrics()
    assert metrics["rollout/partial/segments_mean"] == pytest.approx((1 + 1 + 1 + 1 + 3 + 3) / 6)
    assert metrics["rollout/partial/buffered_responses"] == 2.0  # the second batch's long groups, two segments in


def test_in_flight_cap_gives_a_second_segment_at_the_same_version():
    # gen batch 1 → at most 2 groups in flight. Both are long: with nothing to advance and the cap reached, a round
    # advances them again (same weights, so no version is added) instead of drawing more prompts.
    engine = ScriptedEngine()
    src = _source(engine, [9, 9, 9, 9], gen_batch=1)
    assert src.round(1, 0, need=1, index=0) is None
    assert src.round(1, 0, need=1, index=1) is None
    assert src.buffer.num_in_flight() == 2
    assert src.round(1, 0, need=1, index=2) is None  # the cap: both advanced a second time in step 1
    assert src.buffer.next_key == 2 and [r.segments for g in src.buffer.groups for r in g.responses] == [2, 2]
    rollout, _, _, _ = src.round(1, 0, need=1, index=3)
    assert rollout.token_versions[0].tolist() == [0] * 6 and rollout.truncated.tolist() == [True]


def test_a_group_waiting_for_tool_calls_does_not_hold_back_the_draw():
    """Two long groups could fill a need of 2, so a round advances them and draws nothing (the test above), unless
    they wait for tool calls that outlasted their round (multi-turn, ``Conversation.calls_in_flight``: set here by
    hand on the single-turn responses, since only the draw is under test): such calls may run until their timeout,
    so a new generation batch is drawn, and its short groups fill the batch in the same round."""
    engine = ScriptedEngine()
    src = _source(engine, [9, 9, 2, 2], gen_batch=2)
    assert src.round(step=1, version=0, need=2, index=0) is None and src.buffer.next_key == 2
    for g in src.buffer.groups:
        g.responses[0].calls_in_flight = [{"name": "lookup", "arguments": {"box": "a"}}]
    assert src.metrics()["rollout/partial/awaiting_tools"] == 2.0
    rollout, items, _, _ = src.round(step=2, version=1, need=2, index=0)
    assert src.buffer.next_key == 4 and [it["input_ids"][0] for it in items] == [2, 2]
