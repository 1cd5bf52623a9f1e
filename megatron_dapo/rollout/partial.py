"""Partial rollout: the request-level rollout, with responses generated a segment at a time and resumable between
segments (``rollout.partial_rollout``, docs/async.md).

A *group* is one prompt and its ``n`` responses. Each response is a resumable request: the tokens generated so far
(as token ids: a continuation is ``prompt + tokens so far``, never re-tokenised), their rollout log-probs and, per
token, the policy version that produced it. ``PartialRollout`` holds the groups in flight and asks the engine for
the next segment of many responses in one call (``RolloutEngine.generate_segments``):

* a segment is at most ``segment_length`` tokens, except a response's ``max_segments``-th, which may use the rest of
  the budget, so a response ends within ``max_segments`` segments and spans at most that many versions;
* a response ends at a stop token or at ``max_response_length`` tokens (then it is truncated);
* a group is *done* when all its responses have ended; done groups leave oldest first (``take_done``), so scoring,
  overlong shaping and dynamic sampling only ever see whole responses;
* every request carries its own seed key ``(group key, sample, segment)``: a segment's tokens depend neither on the
  replica nor on the round it ran in.

Multi-turn (``rollout.multi_turn``): the responses are ``Conversation``s, advanced by ``MultiTurnRollout.advance``.
A segment is the model turn under way, cut at ``segment_length`` tokens, plus its tool turn when the turn ends with
tool calls; the ``max_segments``-th runs the conversation to its end. A conversation is thus resumable between turns
and inside one, and still spans at most ``max_segments`` versions. Calls that outlast their round
(``multi_turn.tool_round_wait_s``) go on running: the conversation waits for them in later rounds, which are not
segments until it moves again, so a hung call holds back only its own group.

The buffer is a checkpoint component (``state_dict``/``load_state_dict``): a resumed run continues every buffered
response where it stopped, so no prompt is lost or drawn twice. It is pure bookkeeping over the engine's API: the
engine may sleep between steps (nothing is kept in vLLM; a continuation prefills its prefix again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Protocol

from megatron_dapo.config.plan import PartialPlan
from megatron_dapo.rollout.types import (
    Conversation,
    Response,
    RolloutBatch,
    SamplingSpec,
    Segment,
    SegmentRequest,
    attach_turns,
    build_rollout_batch,
    response_from_dict,
)

__all__ = ["Group", "PartialRollout", "Response", "group_from_dict"]


class SegmentEngine(Protocol):
    def generate_segments(
        self, requests: Sequence[SegmentRequest], sampling: SamplingSpec, seed_offset: int = 0
    ) -> list[Segment]: ...


class ConversationEngine(Protocol):
    """``rollout/multi_turn.py``'s ``MultiTurnRollout``: a segment of many conversations at once."""

    def advance(
        self, convs: Sequence[Conversation], caps: Sequence[Optional[int]], sampling: SamplingSpec, seed_offset: int
    ) -> list[Conversation]: ...


@dataclass
class Group:
    """A prompt and its responses. ``key`` is unique over the run (its requests' seed and its group id); ``item`` is
    the prompt's index in the training dataset."""

    key: int
    item: int
    prompt: list[int]
    responses: list[Response]

    @property
    def done(self) -> bool:
        return all(r.done for r in self.responses)

    @property
    def awaiting_tools(self) -> bool:
        """A response waits for tool calls that outlasted an earlier round (multi-turn): the group ends when they do."""
        return any(getattr(r, "calls_in_flight", None) for r in self.responses if not r.done)

    @property
    def started(self) -> bool:
        """A segment of it was generated (a group drawn but not started holds no token, so no version)."""
        return any(r.segments for r in self.responses)


class PartialRollout:
    """The groups in flight, advanced one segment per response per round (see the module docstring)."""

    def __init__(
        self,
        engine: SegmentEngine,
        plan: PartialPlan,
        max_response_length: int,
        conversations: Optional[ConversationEngine] = None,
    ) -> None:
        self.engine, self.plan, self.budget = engine, plan, int(max_response_length)
        self.conversations = conversations  # multi-turn: responses are conversations, advanced by it
        self.groups: list[Group] = []  # oldest first
        self.next_key = 0

    # ------------------------------------------------------------------------------------------- state

    def add(
        self, items: Sequence[int], prompts: Sequence[Sequence[int]], n: int, rows: Optional[Sequence[dict]] = None
    ) -> None:
        """New groups: the prompts of dataset rows ``items``, ``n`` empty responses each (conversations of the
        dataset ``rows`` in a multi-turn run)."""
        for k, (item, prompt) in enumerate(zip(items, prompts)):
            if self.conversations is None:
                responses: list[Response] = [Response() for _ in range(n)]
            else:  # keyed by the group: ids and seeds unique over the run
                responses = [Conversation.of_item(rows[k], self.next_key, j, tag="g") for j in range(n)]
            self.groups.append(Group(self.next_key, int(item), [int(t) for t in prompt], responses))
            self.next_key += 1

    def pending(self, step: int, again: bool = False) -> list[tuple[Group, int]]:
        """(group, sample) of every unfinished response not yet advanced at ``step`` (``again``: advanced or not)."""
        return [
            (g, j)
            for g in self.groups
            for j, r in enumerate(g.responses)
            if not r.done and (again or r.last_step < step)
        ]

    def num_done(self) -> int:
        return sum(g.done for g in self.groups)

    def num_in_flight(self) -> int:
        """Groups with a response still being generated."""
        return sum(not g.done for g in self.groups)

    def unstarted(self) -> list[Group]:
        """Groups drawn whose first segment is still to come, oldest first."""
        return [g for g in self.groups if not g.started]

    def awaiting_tools(self) -> int:
        """Conversations whose tool calls went on running after their round ended (multi-turn)."""
        return sum(1 for g in self.groups for r in g.responses if not r.done and getattr(r, "calls_in_flight", None))

    def buffered_responses(self) -> int:
        """Unfinished responses that hold at least one segment (what a step carries over to the next)."""
        return sum(1 for g in self.groups for r in g.responses if not r.done and r.segments)

    # ------------------------------------------------------------------------------------------- generation

    def advance(
        self, todo: Sequence[tuple[Group, int]], step: int, version: int, sampling: SamplingSpec, seed_offset: int
    ) -> None:
        """The next segment of each (group, sample) in ``todo``, in one engine call, generated by the weights of
        policy ``version`` during ``step``."""
        if not todo:
            return
        if self.conversations is not None:
            self._advance_conversations(todo, step, version, sampling, seed_offset)
            return
        requests = []
        for g, j in todo:
            r = g.responses[j]
            left = self.budget - len(r.tokens)
            size = left if self._last_segment(r) else min(self.plan.segment_length, left)
            requests.append(SegmentRequest(tuple(g.prompt + r.tokens), size, (g.key, j, r.segments)))
        for (g, j), seg in zip(todo, self.engine.generate_segments(requests, sampling, seed_offset)):
            self._extend(g.responses[j], seg, step, version)

    def _last_segment(self, r: Response) -> bool:
        return r.segments + 1 >= self.plan.max_segments

    def _advance_conversations(
        self, todo: Sequence[tuple[Group, int]], step: int, version: int, sampling: SamplingSpec, seed_offset: int
    ) -> None:
        """Multi-turn: a segment of each conversation (``MultiTurnRollout.advance``): the model turn under way, cut
        at ``segment_length`` tokens, and its tool turn; a conversation's ``max_segments``-th runs to its end, so
        the staleness bound holds as for single-turn responses."""
        convs = [g.responses[j] for g, j in todo]
        before = [len(c.tokens) for c in convs]
        caps = [None if self._last_segment(c) else self.plan.segment_length for c in convs]
        for (g, j), c, start in zip(todo, self.conversations.advance(convs, caps, sampling, seed_offset), before):
            c.versions += [version] * (len(c.tokens) - start)  # tool turns take their model turn's version
            c.segments += len(c.tokens) > start  # a round that only waited for its tool calls is not a segment
            c.last_step = step
            g.responses[j] = c

    def _extend(self, r: Response, seg: Segment, step: int, version: int) -> None:
        r.tokens += seg.tokens
        r.log_probs += seg.log_probs
        r.versions += [version] * len(seg.tokens)
        r.segments += 1
        r.last_step = step
        at_budget = len(r.tokens) >= self.budget
        r.done = at_budget or not seg.hit_budget  # not stopped by its budget: it ended at a stop token
        r.truncated = at_budget and seg.hit_budget

    def take_done(self, limit: int) -> list[Group]:
        """Up to ``limit`` done groups, oldest first; they leave the buffer."""
        taken: list[Group] = []
        kept: list[Group] = []
        for g in self.groups:
            (taken if g.done and len(taken) < limit else kept).append(g)
        self.groups = kept
        return taken

    # ------------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"next_key": self.next_key, "groups": [asdict(g) for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_key = int(state["next_key"])
        self.groups = [group_from_dict(g) for g in state["groups"]]


def group_from_dict(state: dict[str, Any]) -> Group:
    """A ``Group`` from its ``dataclasses.asdict`` (single-turn responses or conversations)."""
    responses = [response_from_dict(r) for r in state["responses"]]
    return Group(int(state["key"]), int(state["item"]), list(state["prompt"]), responses)


def groups_to_rollout(groups: Sequence[Group], pad_token_id: int) -> RolloutBatch:
    """Done groups as a padded ``RolloutBatch`` (a group's responses contiguous, ``prompt_index`` = the group's
    position in ``groups``), with each token's policy version in ``token_versions``."""
    rows = [(i, r) for i, g in enumerate(groups) for r in g.responses]
    batch = build_rollout_batch(
        [g.prompt for g in groups],
        responses=[r.tokens for _, r in rows],
        log_probs=[r.log_probs for _, r in rows],
        truncated=[r.truncated for _, r in rows],
        prompt_index=[i for i, _ in rows],
        pad_token_id=pad_token_id,
    )
    versions = batch.responses.new_zeros(batch.responses.shape)
    for row, (_, r) in enumerate(rows):
        versions[row, : len(r.versions)] = batch.responses.new_tensor(r.versions)
    batch.token_versions = versions
    if rows and isinstance(rows[0][1], Conversation):
        attach_turns(batch, [r for _, r in rows])
    return batch


def segments_of(groups: Sequence[Group]) -> list[int]:
    """The number of segments of every response of ``groups``."""
    return [r.segments for g in groups for r in g.responses]
