"""Multi-turn rollout with tool calls (``rollout.multi_turn``, docs/agent.md), on the engine's request-level API.

A response is a conversation: model turns and tool turns alternate until the model answers without a tool call,
``max_assistant_turns`` model turns were made, or ``data.max_response_length`` tokens are used (the response budget
counts every token, tool output included). Each sample is its own chain of engine requests: when a model turn ends
with Hermes tool calls (``agent/hermes.py``), the calls go to the tool process (``agent/host.py``) and the engine
keeps decoding every other sample; when the results are back, the tool turn (rendered by the chat template,
``agent/chat.py``) is appended and the next model turn is queued as ``prompt + everything so far``. There is no
barrier per turn.

Token in, token out: the response is exactly the sampled tokens and the rendered tool turns, concatenated; model
output is decoded only to be read (tool calls, the reward's messages), never re-encoded. ``loss_mask`` is 1 on
sampled tokens and 0 on tool turns, whose rollout log-prob is 0.

Ranks. Prompts are dealt to the engine's replicas as in ``RolloutEngine.generate``. A replica's TP ranks run the same
loop and must add the same requests between the same engine steps, so tools run on the replica's first rank only,
which hands the results that are ready to its peers (one small broadcast per engine step, only when rollout TP > 1).
Seeds: a sample's first turn is seeded exactly like ``generate``'s request for it, each later turn by its own key, so
a conversation does not depend on the replica or on when its tools answered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict
from typing import Any, Optional, Protocol

import torch

from megatron_dapo.agent.chat import ToolTurns
from megatron_dapo.agent.hermes import ToolCall, parse_tool_calls
from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import ToolResult, read_tool_config
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.rollout.engine import assign_prompts
from megatron_dapo.rollout.routing import routed_experts_fields, row_routing
from megatron_dapo.rollout.types import (
    Conversation,
    FinishedSink,
    RolloutBatch,
    SamplingSpec,
    Segment,
    attach_turns,
    batch_of_rows,
)

__all__ = ["Conversation", "MultiTurnRollout", "SingleTurn", "build_generator", "tool_metrics", "tool_schemas"]

logger = logging.getLogger(__name__)

TOOL_STATUSES = ("error", "timeout", "unknown_tool", "bad_call", "crashed", "abandoned")


class RequestEngine(Protocol):
    dp_size: int
    dp_rank: int
    tp_rank: int
    pad_token_id: int
    routing_arch: Any  # the model's MoE layout with routing replay (``actor.router_replay=rollout``), else None

    def add_request(
        self, request_id: str, token_ids: Sequence[int], sampling: SamplingSpec, max_tokens: int, seed_key: tuple
    ) -> None: ...
    def step(self) -> list[tuple[str, Segment]]: ...
    def has_unfinished(self) -> bool: ...
    def seeded_session(self, run: Any, seed_offset: int) -> Any: ...
    def gather_objects(self, objects: list) -> list: ...
    def broadcast_in_replica(self, obj: Any) -> Any: ...


class ToolExecutor(Protocol):
    """``agent/host.py``'s ``ToolHost``: futures that never raise."""

    def create(self, instance_id: str, tools_kwargs: Optional[dict]) -> Future: ...
    def call(self, instance_id: str, call: ToolCall) -> Future: ...
    def release(self, instance_id: str) -> Future: ...
    def close(self) -> None: ...


class MultiTurnRollout:
    """Conversations of many samples, concurrently, on one engine (module docstring)."""

    def __init__(
        self,
        engine: RequestEngine,
        tools: Optional[ToolExecutor],
        turns: ToolTurns,
        tokenizer: Any,
        cfg: MultiTurnConfig,
        max_response_length: int,
    ) -> None:
        self.engine, self.tools, self.turns, self.tokenizer, self.cfg = engine, tools, turns, tokenizer, cfg
        self.budget = int(max_response_length)
        self._infos: list[dict] = []  # of every sample generated since the last metrics()
        self._live: set[str] = set()  # this rank's tool instances (created, not released yet)
        self._in_flight: dict[str, list[Future]] = {}  # calls a round left running, by conversation (the leader's)
        self._hinted = False  # the console was told once that a timed-out call held a batch

    def generate(
        self,
        items: Sequence[dict],
        sampling: SamplingSpec,
        seed_offset: int = 0,
        on_step: Optional[FinishedSink] = None,
    ) -> RolloutBatch:
        """``sampling.n`` conversations per item (dataset items: ``input_ids``, ``prompt_messages``,
        ``extra_info``), each to its end; collective over all ranks. ``on_step`` gets the conversations that ended
        after every engine step of this rank's replica (``types.FinishedSink``). Returns the whole batch on every
        rank, in prompt order."""
        engine = self.engine
        prompts = [list(map(int, it["input_ids"])) for it in items]
        share = assign_prompts([len(p) for p in prompts], engine.dp_size)[engine.dp_rank]
        convs = [Conversation.of_item(items[i], i, j) for i in share for j in range(sampling.n)]

        def seed_key(c: Conversation) -> tuple:  # a first turn keyed as ``generate`` keys its request
            return (seed_offset, c.prompt_index, c.sample if c.requests == 0 else f"{c.sample}.{c.requests}")

        routes = self._drive(convs, {}, sampling, seed_key, seed_offset, on_step)
        rows = engine.gather_objects(
            [(c.prompt_index, c.sample, c.tokens, c.log_probs, c.truncated, c, routes.get(c.key)) for c in convs]
        )
        rows.sort(key=lambda r: (r[0], r[1]))
        batch = attach_turns(batch_of_rows(prompts, rows, engine.pad_token_id), [r[5] for r in rows])
        if rows and rows[0][6] is not None:
            width = batch.prompts.shape[1], batch.responses.shape[1]
            batch.routed_experts = routed_experts_fields(
                [r[6] for r in rows], [len(prompts[r[0]]) for r in rows], *width
            )
        self._infos += batch.turns
        return batch

    def advance(
        self, convs: Sequence[Conversation], caps: Sequence[Optional[int]], sampling: SamplingSpec, seed_offset: int
    ) -> list[Conversation]:
        """One segment of each conversation (partial rollout, ``rollout/partial.py``); collective over all ranks.

        With a cap, a segment is the model turn under way, cut after ``cap`` tokens, and when that turn ends with
        tool calls, its tool turn: the conversation then waits between two turns (or inside a turn) for the next
        segment. Without one (a response's last segment), the conversation runs to its end. A conversation stays on
        the same replica from segment to segment (its tool instance lives there) and each request is seeded by its
        own key, so the tokens depend neither on the round nor on the replica. Returns the conversations advanced,
        in order, on every rank."""
        engine = self.engine
        mine = [k for k in range(len(convs)) if _replica_of(convs[k], engine.dp_size) == engine.dp_rank]
        share = [convs[k] for k in mine]
        limits = {convs[k].key: caps[k] for k in mine if caps[k] is not None}

        def seed_key(c: Conversation) -> tuple:
            return (c.prompt_index, c.sample, f"r{c.requests}")

        self._drive(share, limits, sampling, seed_key, seed_offset)
        rows = sorted(engine.gather_objects([(k, c) for k, c in zip(mine, share)]), key=lambda r: r[0])
        return [c for _, c in rows]

    def metrics(self) -> dict[str, float]:
        """``tool/*`` over the samples generated since the last call (every rank's)."""
        infos, self._infos = self._infos, []
        return tool_metrics(infos)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    # ------------------------------------------------------------------------------------------- the loop

    def _drive(
        self,
        convs: list,
        limits: dict,
        sampling: SamplingSpec,
        seed_key: Any,
        seed_offset: int,
        on_step: Optional[FinishedSink] = None,
    ) -> dict:
        """This replica's conversations through ``_run`` under the engine's seeding; their routing (routing replay)."""
        if not convs:
            return {}
        return self.engine.seeded_session(lambda: self._run(convs, limits, sampling, seed_key, on_step), seed_offset)

    def _run(
        self,
        convs: list[Conversation],
        limits: dict,
        sampling: SamplingSpec,
        seed_key: Any,
        on_step: Optional[FinishedSink] = None,
    ) -> dict:
        """Drive the conversations, each to its end or, when ``limits`` caps it, through one segment: engine steps,
        and tool turns as their results arrive; the conversations that ended go to ``on_step`` after each engine
        step. A capped conversation whose calls are still running ``tool_round_wait_s`` after the engine ran out of
        requests leaves the round with them (``_settle``); the round that takes it up again starts with its tool
        turn and its next model turn. Returns each conversation's routing (routing replay only)."""
        leader = self.engine.tp_rank == 0
        tools = self.tools if leader else None
        self._open_tools(convs if tools is not None else [])
        pending: dict[str, Conversation] = {}  # request id → its conversation
        waiting: dict[str, tuple[Conversation, list[Future]]] = {}  # tool calls in flight (futures: the leader's)
        routes: dict[str, tuple[Any, int]] = {}  # the last request's routing, and the tokens it covers
        carried_in: set[str] = set()  # came waiting for calls of an earlier round: its segment goes on after them
        called_at: dict[str, float] = {}  # when each waiting conversation's calls were made (or carried in)
        for c in convs:
            if c.calls_in_flight:
                waiting[c.key] = (c, self._calls_in_flight(c) if tools is not None else [])
                carried_in.add(c.key)
                called_at[c.key] = time.monotonic()
            else:
                self._queue(c, sampling, seed_key, pending, limits.get(c.key))
        idle_since: Optional[float] = None  # when the engine first ran out of requests in this round
        while pending or waiting:
            ended: list[Conversation] = []
            for request_id, seg in self.engine.step() if self.engine.has_unfinished() else []:
                c = pending.pop(request_id)
                calls = self._model_turn(c, seg)
                if seg.routed_experts is not None:
                    routes[c.key] = (seg.routed_experts, len(c.tokens))
                if calls:  # a TP peer waits with no futures: the leader's results arrive by broadcast
                    c.calls_in_flight = [asdict(call) for call in calls]
                    waiting[c.key] = (c, [tools.call(c.key, call) for call in calls] if tools is not None else [])
                    called_at[c.key] = time.monotonic()
                elif c.done:
                    ended.append(c)
            if idle_since is None and not self.engine.has_unfinished():
                idle_since = time.monotonic()
            settled = None
            if leader:
                deadline = None if idle_since is None else idle_since + self.cfg.tool_round_wait_s
                block = not self.engine.has_unfinished()
                settled = _settle(waiting, set(limits), deadline, block, called_at, self.cfg.tool_abandon_after_s)
            ready, carried_out = self.engine.broadcast_in_replica(settled)
            for key in carried_out:  # its calls go on running; the conversation waits for them in a later round
                _, futures = waiting.pop(key)
                if tools is not None:
                    self._in_flight[key] = futures
            for key, results in ready:
                c, _ = waiting.pop(key)
                if leader and key not in limits and not self.engine.has_unfinished():
                    self._hint_if_held(results)
                self._tool_turn(c, results)
                if c.done:
                    ended.append(c)
                elif key not in limits or key in carried_in:  # a capped segment ends after its own tool turn
                    carried_in.discard(key)
                    self._queue(c, sampling, seed_key, pending, limits.get(key))
            if on_step is not None:
                on_step([(c.prompt_index, c.sample, list(c.tokens), c.info()) for c in ended])
        self._close_tools([c for c in convs if c.done] if tools is not None else [])
        return {c.key: self._routing(c, *routes[c.key]) for c in convs if c.key in routes}

    def _hint_if_held(self, results: Sequence[Any]) -> None:
        """Once per run: a timed-out call that the batch waited for (nothing else was left to run) is the user's to
        act on, since ``tool_abandon_after_s`` would have cut that wait."""
        if self._hinted or self.cfg.tool_abandon_after_s is not None:
            return
        if any(r.status == "timeout" for r in results):
            self._hinted = True
            logger.warning(
                "a tool call timed out (rollout.multi_turn.tool_timeout_s=%gs) and its generation batch waited for it"
                " with nothing else to run; rollout.multi_turn.tool_abandon_after_s stops waiting for such calls"
                " sooner (docs/agent.md)",
                self.cfg.tool_timeout_s,
            )

    def _calls_in_flight(self, c: Conversation) -> list[Future]:
        """The futures of ``c``'s unanswered calls: still running from the round that left them, or, where they were
        lost (a run resumed from a checkpoint; tool state is not checkpointed), the same calls made again."""
        futures = self._in_flight.pop(c.key, None)
        return futures if futures is not None else [self.tools.call(c.key, ToolCall(**d)) for d in c.calls_in_flight]

    def _open_tools(self, convs: Sequence[Conversation]) -> None:
        """Tool instances for the conversations that have none on this rank (a new one, or one resumed from a
        checkpoint: tool state is not checkpointed). A failed create is not fatal: the calls answer with its error."""
        fresh = [c for c in convs if c.key not in self._live]
        wait([self.tools.create(c.key, c.tools_kwargs) for c in fresh])
        self._live.update(c.key for c in fresh)

    def _close_tools(self, ended: Sequence[Conversation]) -> None:
        wait([self.tools.release(c.key) for c in ended if c.key in self._live])
        self._live.difference_update(c.key for c in ended)

    def _routing(self, c: Conversation, routed_experts: Any, covered: int) -> Any:
        """``[prompt + response, L_moe, K]`` of ``c`` from its last request's routing, which covers the prompt, every
        earlier turn (vLLM keeps the routing of prefix-cached tokens with their KV blocks,
        ``vllm/distributed/aux_output_connector``) and the last model turn; a tool turn after it (a response cut in
        its tool turn) has no record and gets 0, like the unrun last token: no sampled token's log-prob sees them."""
        routing = row_routing(routed_experts, len(c.prompt), covered, self.engine.routing_arch)
        tail = routing.new_zeros((len(c.tokens) - covered, *routing.shape[1:]))
        return torch.cat([routing, tail])

    def _queue(self, c: Conversation, sampling: SamplingSpec, seed_key: Any, pending: dict, cap: Optional[int]) -> None:
        """The next request of ``c``: its next model turn, or the rest of a turn a segment cut."""
        room = self.budget - len(c.tokens)
        request_id = f"{c.key}-{c.requests}"
        self.engine.add_request(
            request_id, c.prompt + c.tokens, sampling, room if cap is None else min(room, cap), seed_key(c)
        )
        c.requests += 1
        pending[request_id] = c

    def _model_turn(self, c: Conversation, seg: Segment) -> list[ToolCall]:
        """Append sampled tokens; the turn's tool calls (at most ``max_parallel_calls``) when it ended with some,
        else [] (``c`` ended, or a segment's cap cut the turn, which the next request continues)."""
        if not c.open_turn:
            c.turn_start = len(c.tokens)
        c.tokens += seg.tokens
        c.log_probs += seg.log_probs
        c.loss_mask += [1] * len(seg.tokens)
        at_budget = len(c.tokens) >= self.budget
        c.open_turn = seg.hit_budget and not at_budget
        if c.open_turn:
            return []
        turn = c.tokens[c.turn_start :]
        c.turns += 1
        c.messages.append({"role": "assistant", "content": self.tokenizer.decode(turn, skip_special_tokens=True)})
        if seg.hit_budget:  # the response's budget is used up
            c.done = c.truncated = True
            return []
        _, calls = parse_tool_calls(self.tokenizer.decode(turn, skip_special_tokens=False))
        max_turns = self.cfg.max_assistant_turns
        if not calls or (max_turns is not None and c.turns >= max_turns) or at_budget:
            c.done = True
            return []
        return calls[: self.cfg.max_parallel_calls]

    def _tool_turn(self, c: Conversation, results: Sequence[Any]) -> None:
        """Append the tool turn (not trained); cut at the response budget, which then ends ``c`` truncated."""
        texts = self.turns.texts([r.text for r in results])
        c.messages += [{"role": "tool", "content": t} for t in texts]
        c.tool_rewards += [float(r.reward) for r in results]
        c.tool_status += [r.status for r in results]
        c.tool_latency += [float(r.latency_s) for r in results]
        c.calls_in_flight = []
        tokens = self.turns.tokens(texts)
        room = self.budget - len(c.tokens)
        if len(tokens) >= room:  # no token left for the model's next turn
            tokens, c.done, c.truncated = tokens[:room], True, True
        c.tokens += tokens
        c.log_probs += [0.0] * len(tokens)
        c.loss_mask += [0] * len(tokens)


def _replica_of(c: Conversation, replicas: int) -> int:
    """The replica that advances ``c`` in every segment (so its tool instance stays where it was created)."""
    return (c.prompt_index * 7919 + c.sample) % replicas


def _settle(
    waiting: dict[str, tuple[Conversation, list[Future]]],
    capped: set[str],
    deadline: Optional[float],
    block: bool,
    called_at: Optional[dict[str, float]] = None,
    abandon_after_s: Optional[float] = None,
) -> tuple[list[tuple[str, list]], list[str]]:
    """The leader's decision, which its TP peers follow: the conversations whose calls are all answered, with the
    results, and the capped ones to carry into a later round with their calls still running. With ``block`` (no
    engine request left), wait for an answer first, but past ``deadline`` carry the capped conversations instead of
    waiting for them. An uncapped one (synchronous rollout, or a response's last segment) is waited for until its
    calls, made at ``called_at[key]``, have waited ``abandon_after_s`` (``tool_abandon_after_s``; without it,
    always): its unanswered calls are then answered as ``abandoned`` and it goes on, while the calls themselves run on
    to their timeout in their worker."""
    give_up: dict[str, float] = {}  # the uncapped conversations' times to stop waiting
    if abandon_after_s is not None and called_at is not None:
        give_up = {key: called_at[key] + abandon_after_s for key in waiting if key not in capped}

    def answered(futures: list[Future]) -> bool:
        return bool(futures) and all(f.done() for f in futures)

    while block and waiting and not any(answered(fs) for _, fs in waiting.values()):
        now = time.monotonic()
        carryable = [key for key in waiting if key in capped]
        if deadline is not None and carryable and deadline <= now:
            return [], carryable
        late = [key for key, at in give_up.items() if at <= now]
        if late:
            return [
                (key, [_result(f) if f.done() else _abandoned(now - called_at[key]) for f in waiting[key][1]])
                for key in late
            ], []
        times = list(give_up.values())
        if deadline is not None and carryable:
            times.append(deadline)
        timeout = max(0.0, min(times) - now) if times else None
        wait([f for _, fs in waiting.values() for f in fs if not f.done()], timeout, FIRST_COMPLETED)
    return [(key, [_result(f) for f in fs]) for key, (_, fs) in waiting.items() if answered(fs)], []


def _abandoned(waited_s: float) -> ToolResult:
    """What the model reads for a call its conversation stopped waiting for (``tool_abandon_after_s``)."""
    text = "error: the tool did not answer in time; the call was abandoned"
    return ToolResult(text, status="abandoned", latency_s=waited_s)


def _result(future: Future) -> Any:
    """A call's ``ToolResult``; the executor never fails a future, but if one does the model reads why."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's message, never the run's
        return ToolResult(f"error: the tool call failed: {type(exc).__name__}: {exc}", status="crashed")


def tool_metrics(infos: Sequence[dict]) -> dict[str, float]:
    """``tool/*`` of a batch of samples: calls and failures by kind (counts), calls and turns per sample, the share
    of samples that called a tool, and call latency."""
    if not infos:
        return {}
    statuses = [s for info in infos for s in info["tool_status"]]
    latency = [x for info in infos for x in info["tool_latency"]]
    out = {
        "tool/calls": float(len(statuses)),
        **{f"tool/{kind}": float(statuses.count(kind)) for kind in TOOL_STATUSES},
        "tool/calls_per_sample": len(statuses) / len(infos),
        "tool/turns_per_sample": sum(info["num_turns"] for info in infos) / len(infos),
        "tool/called_frac": sum(info["tool_calls"] > 0 for info in infos) / len(infos),
    }
    if latency:
        out["tool/latency_mean_s"] = sum(latency) / len(latency)
        out["tool/latency_max_s"] = max(latency)
    return out


class SingleTurn:
    """The single-turn rollout behind the same ``generate(items, ...)`` as ``MultiTurnRollout``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(
        self,
        items: Sequence[dict],
        sampling: SamplingSpec,
        seed_offset: int = 0,
        on_step: Optional[FinishedSink] = None,
    ) -> RolloutBatch:
        prompts = [it["input_ids"] for it in items]
        return self.engine.generate(prompts, sampling, seed_offset=seed_offset, on_step=on_step)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None


def build_generator(mt: MultiTurnConfig, max_response_length: int, engine: Any, tokenizer: Any) -> Any:
    """The run's rollout behind ``generate(items, sampling, seed_offset)``: ``SingleTurn``, or, with
    ``rollout.multi_turn.enable`` (``mt``), ``MultiTurnRollout`` with this rank's tool process (replica leaders
    only); a response's budget is ``max_response_length`` tokens (``data.max_response_length``)."""
    if not mt.enable:
        return SingleTurn(engine)
    host = None
    if engine.tp_rank == 0:
        specs = read_tool_config(mt.tool_config_path)
        host = ToolHost(
            specs, mt.tool_timeout_s, mt.max_concurrent_tool_calls, memory_mb=mt.tool_memory_mb, workers=mt.tool_workers
        )
        host.start()
    turns = ToolTurns(tokenizer, mt.max_tool_response_length, mt.tool_response_truncate_side)
    return MultiTurnRollout(engine, host, turns, tokenizer, mt, max_response_length)


def tool_schemas(mt: MultiTurnConfig) -> Optional[list[dict]]:
    """The tools' OpenAI schemas of a multi-turn run (``rollout.multi_turn``: what the chat template lists in the
    prompt), else None."""
    return [s.schema for s in read_tool_config(mt.tool_config_path)] if mt.enable else None
