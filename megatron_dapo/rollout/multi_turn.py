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

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from megatron_dapo.agent.chat import ToolTurns
from megatron_dapo.agent.hermes import ToolCall, parse_tool_calls
from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import ToolResult, read_tool_config
from megatron_dapo.config.schema import ExperimentConfig, MultiTurnConfig
from megatron_dapo.rollout.engine import assign_prompts
from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec, Segment, batch_of_rows

__all__ = ["Conversation", "MultiTurnRollout", "SingleTurn", "build_generator", "tool_metrics", "tool_schemas"]

TOOL_STATUSES = ("error", "timeout", "unknown_tool", "bad_call", "crashed")


class RequestEngine(Protocol):
    dp_size: int
    dp_rank: int
    tp_rank: int
    pad_token_id: int

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


@dataclass
class Conversation:
    """One sample: its prompt, the response so far (tokens, log-probs, loss mask) and the conversation as text."""

    prompt_index: int
    sample: int
    prompt: list[int]
    messages: list[dict]  # the prompt's messages, then every assistant and tool turn
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0  # model turns
    tool_rewards: list[float] = field(default_factory=list)
    tool_status: list[str] = field(default_factory=list)  # one per call: ok, or how it failed
    tool_latency: list[float] = field(default_factory=list)
    truncated: bool = False
    done: bool = False

    @property
    def key(self) -> str:
        return f"{self.prompt_index}-{self.sample}"

    def info(self) -> dict:
        """What the reward function gets in ``extra_info`` (verl's names) and what the metrics count."""
        return {
            "messages": self.messages,
            "num_turns": self.turns,
            "tool_calls": len(self.tool_status),
            "tool_rewards": self.tool_rewards,
            "tool_status": self.tool_status,
            "tool_latency": self.tool_latency,
        }


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

    def generate(self, items: Sequence[dict], sampling: SamplingSpec, seed_offset: int = 0) -> RolloutBatch:
        """``sampling.n`` conversations per item (dataset items: ``input_ids``, ``prompt_messages``,
        ``extra_info``); collective over all ranks. Returns the whole batch on every rank, in prompt order."""
        engine = self.engine
        prompts = [list(map(int, it["input_ids"])) for it in items]
        share = assign_prompts([len(p) for p in prompts], engine.dp_size)[engine.dp_rank]
        convs = [Conversation(i, j, prompts[i], _prompt_messages(items[i])) for i in share for j in range(sampling.n)]
        if convs:
            kwargs = {i: (items[i].get("extra_info") or {}).get("tools_kwargs") for i in share}
            engine.seeded_session(lambda: self._run(convs, kwargs, sampling, seed_offset), seed_offset)
        rows = engine.gather_objects([(c.prompt_index, c.sample, c.tokens, c.log_probs, c.truncated, c) for c in convs])
        rows.sort(key=lambda r: (r[0], r[1]))
        batch = batch_of_rows(prompts, rows, engine.pad_token_id)
        mask = torch.zeros_like(batch.response_mask)
        for row, r in enumerate(rows):
            mask[row, : len(r[5].loss_mask)] = torch.as_tensor(r[5].loss_mask, dtype=mask.dtype)
        batch.loss_mask, batch.turns = mask, [r[5].info() for r in rows]
        self._infos += batch.turns
        return batch

    def metrics(self) -> dict[str, float]:
        """``tool/*`` over the samples generated since the last call (every rank's)."""
        infos, self._infos = self._infos, []
        return tool_metrics(infos)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    # ------------------------------------------------------------------------------------------- the loop

    def _run(self, convs: list[Conversation], kwargs: dict, sampling: SamplingSpec, seed_offset: int) -> None:
        """Drive every conversation to its end: engine steps, and tool turns as their results arrive."""
        leader = self.engine.tp_rank == 0
        tools = self.tools if leader else None
        if tools is not None:  # a failed create is not fatal: the sample's calls then answer with the tool's error
            wait([tools.create(c.key, kwargs.get(c.prompt_index)) for c in convs])
        pending: dict[str, Conversation] = {}  # request id → its conversation
        waiting: dict[str, tuple[Conversation, list[Future]]] = {}  # the leader's tool calls in flight
        for c in convs:
            self._queue(c, sampling, seed_offset, pending)
        while pending or waiting:
            for request_id, seg in self.engine.step() if self.engine.has_unfinished() else []:
                c = pending.pop(request_id)
                calls = self._model_turn(c, seg)
                if calls and tools is not None:
                    waiting[c.key] = (c, [tools.call(c.key, call) for call in calls])
                elif calls:
                    waiting[c.key] = (c, [])  # a TP peer: the leader's results arrive by broadcast
            ready = _ready(waiting, block=not self.engine.has_unfinished()) if leader else None
            for key, results in self.engine.broadcast_in_replica(ready) or []:
                c, _ = waiting.pop(key)
                self._tool_turn(c, results)
                if not c.done:
                    self._queue(c, sampling, seed_offset, pending)
        if tools is not None:
            wait([tools.release(c.key) for c in convs])

    def _queue(self, c: Conversation, sampling: SamplingSpec, seed_offset: int, pending: dict) -> None:
        """The next model turn of ``c`` as an engine request (its first turn keyed as ``generate`` keys it)."""
        sample_key: Any = c.sample if c.turns == 0 else f"{c.sample}.{c.turns}"
        request_id = f"{c.key}-{c.turns}"
        room = self.budget - len(c.tokens)
        self.engine.add_request(
            request_id, c.prompt + c.tokens, sampling, room, (seed_offset, c.prompt_index, sample_key)
        )
        pending[request_id] = c

    def _model_turn(self, c: Conversation, seg: Segment) -> list[ToolCall]:
        """Append a sampled turn; its tool calls (at most ``max_parallel_calls``), or [] when ``c`` ended."""
        c.tokens += seg.tokens
        c.log_probs += seg.log_probs
        c.loss_mask += [1] * len(seg.tokens)
        c.turns += 1
        content = self.tokenizer.decode(seg.tokens, skip_special_tokens=True)
        c.messages.append({"role": "assistant", "content": content})
        if seg.hit_budget:  # a turn's budget is the rest of the response's: the response is used up
            c.done = c.truncated = True
            return []
        _, calls = parse_tool_calls(self.tokenizer.decode(seg.tokens, skip_special_tokens=False))
        max_turns = self.cfg.max_assistant_turns
        if not calls or (max_turns is not None and c.turns >= max_turns) or len(c.tokens) >= self.budget:
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
        tokens = self.turns.tokens(texts)
        room = self.budget - len(c.tokens)
        if len(tokens) >= room:  # no token left for the model's next turn
            tokens, c.done, c.truncated = tokens[:room], True, True
        c.tokens += tokens
        c.log_probs += [0.0] * len(tokens)
        c.loss_mask += [0] * len(tokens)


def _prompt_messages(item: dict) -> list[dict]:
    messages = item.get("prompt_messages")
    if isinstance(messages, list):
        return [dict(m) for m in messages]
    return [{"role": "user", "content": str(item.get("raw_prompt", ""))}]


def _ready(waiting: dict[str, tuple[Conversation, list[Future]]], block: bool) -> list[tuple[str, list]]:
    """The conversations whose tool calls are all answered, with the results; with ``block``, wait for one first."""

    def answered(futures: list[Future]) -> bool:
        return bool(futures) and all(f.done() for f in futures)

    while block and waiting and not any(answered(fs) for _, fs in waiting.values()):
        wait([f for _, fs in waiting.values() for f in fs if not f.done()], return_when=FIRST_COMPLETED)
    return [(key, [_result(f) for f in fs]) for key, (_, fs) in waiting.items() if answered(fs)]


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

    def generate(self, items: Sequence[dict], sampling: SamplingSpec, seed_offset: int = 0) -> RolloutBatch:
        return self.engine.generate([it["input_ids"] for it in items], sampling, seed_offset=seed_offset)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None


def build_generator(cfg: ExperimentConfig, engine: Any, tokenizer: Any) -> Any:
    """The run's rollout behind ``generate(items, sampling, seed_offset)``: ``SingleTurn``, or, with
    ``rollout.multi_turn.enable``, ``MultiTurnRollout`` with this rank's tool process (replica leaders only)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return SingleTurn(engine)
    host = None
    if engine.tp_rank == 0:
        specs = read_tool_config(mt.tool_config_path)
        host = ToolHost(specs, mt.tool_timeout_s, mt.max_concurrent_tool_calls, memory_mb=mt.tool_memory_mb)
        host.start()
    turns = ToolTurns(tokenizer, mt.max_tool_response_length, mt.tool_response_truncate_side)
    return MultiTurnRollout(engine, host, turns, tokenizer, mt, cfg.data.max_response_length)


def tool_schemas(cfg: ExperimentConfig) -> Optional[list[dict]]:
    """The tools' OpenAI schemas of a multi-turn run (what the chat template lists in the prompt), else None."""
    mt = cfg.rollout.multi_turn
    return [s.schema for s in read_tool_config(mt.tool_config_path)] if mt.enable else None
