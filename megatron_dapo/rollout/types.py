"""Data that crosses the rollout boundary: sampling settings in, a padded batch of responses out.

``build_rollout_batch`` is the one place that turns ragged prompts/responses into the padded tensors the trainer
consumes; it is pure (no vLLM, no process group) so its padding rules are tested on their own. ``pack_rows`` /
``unpack_rows`` carry a replica's generated rows between ranks as a few compact tensors (the engine's result gather).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from megatron_dapo.config import RolloutConfig


@dataclass(frozen=True)
class SamplingSpec:
    """What to sample for each prompt. Built from the config by ``for_training`` / ``for_validation``.

    ``temperature == 0`` means greedy decoding (vLLM's convention); ``top_k == -1`` and ``top_p == 1`` disable
    those filters. Generation stops at any of ``stop_token_ids`` (the stop token is kept in the response) or
    after ``max_tokens`` tokens (the response is then marked ``truncated``).
    """

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n={self.n}: expected >= 1 responses per prompt")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens={self.max_tokens}: expected >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature={self.temperature}: expected >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p={self.top_p}: expected a value in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingSpec.top_k={self.top_k}: expected -1 (disabled) or a positive count")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def for_training(
        cls, r: RolloutConfig, max_response_length: int, stop_token_ids: Sequence[int] = ()
    ) -> SamplingSpec:
        """``rollout.{n, temperature, top_p, top_k}`` with ``max_tokens = data.max_response_length``."""
        return cls(
            n=r.n,
            temperature=float(r.temperature),
            top_p=float(r.top_p),
            top_k=int(r.top_k),
            max_tokens=max_response_length,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
        )

    @classmethod
    def for_validation(
        cls, r: RolloutConfig, max_response_length: int, stop_token_ids: Sequence[int] = ()
    ) -> SamplingSpec:
        """``rollout.val_kwargs``; ``do_sample: false`` forces greedy decoding (temperature 0, no top-p/top-k)."""
        v = r.val_kwargs
        sample = v.do_sample and v.temperature > 0
        return cls(
            n=v.n,
            temperature=float(v.temperature) if sample else 0.0,
            top_p=float(v.top_p) if sample else 1.0,
            top_k=int(v.top_k) if sample else -1,
            max_tokens=max_response_length,
            stop_token_ids=tuple(int(t) for t in stop_token_ids),
        )


@dataclass(frozen=True)
class SegmentRequest:
    """One segment to generate (``RolloutEngine.generate_segments``): the prompt and the response so far as token
    ids, at most ``max_tokens`` new tokens, and the key of its per-request seed (three integers)."""

    token_ids: tuple[int, ...]
    max_tokens: int
    seed_key: tuple[int, int, int]


@dataclass(frozen=True)
class Segment:
    """A generated segment: its tokens, their log-probs, and whether ``max_tokens`` stopped it (else a stop token,
    kept as its last token)."""

    tokens: list[int]
    log_probs: list[float]
    hit_budget: bool
    # Routing replay only: vLLM's ``routed_experts`` of the request (every token it ran: the prompt, and the output
    # but its last token), as ``rollout/routing.py`` describes.
    routed_experts: Any = None


@dataclass
class Response:
    """One response of the request-level rollout (``rollout/partial.py``): what is generated so far, and where it
    stands."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    segments: int = 0
    done: bool = False
    truncated: bool = False  # ended at the token budget
    last_step: int = -1  # the step that generated its last segment


@dataclass(kw_only=True)
class Conversation(Response):
    """A multi-turn response (``rollout/multi_turn.py``): the prompt, the conversation as text, and per token whether
    the model sampled it (``loss_mask``). Plain data, so that the partial-rollout buffer checkpoints it as JSON and a
    resumed run continues it between (or inside) its turns."""

    prompt_index: int  # the batch position of its prompt (a generation), or its group's key (partial rollout)
    sample: int
    prompt: list[int]
    messages: list[dict]  # the prompt's messages, then every assistant and tool turn
    tools_kwargs: Optional[dict] = None  # the dataset row's ``extra_info.tools_kwargs``
    tag: str = ""  # keeps tool-instance ids of partial rollout's groups apart from a validation's
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0  # model turns
    requests: int = 0  # engine requests made: a model turn, or a segment of one
    turn_start: int = 0  # where the model turn being generated starts in ``tokens``
    open_turn: bool = False  # a segment's token cap cut the model turn: the next request continues it
    tool_rewards: list[float] = field(default_factory=list)
    tool_status: list[str] = field(default_factory=list)  # one per call: ok, or how it failed
    tool_latency: list[float] = field(default_factory=list)
    calls_in_flight: list[dict] = field(default_factory=list)  # its last model turn's calls, not answered yet

    @classmethod
    def of_item(cls, item: dict, prompt_index: int, sample: int, tag: str = "") -> Conversation:
        """A new conversation of a dataset row (``input_ids``, ``prompt_messages``, ``extra_info.tools_kwargs``)."""
        messages = item.get("prompt_messages")
        if isinstance(messages, list):
            messages = [dict(m) for m in messages]
        else:
            messages = [{"role": "user", "content": str(item.get("raw_prompt", ""))}]
        kwargs = (item.get("extra_info") or {}).get("tools_kwargs")
        prompt = [int(t) for t in item["input_ids"]]
        return cls(
            prompt_index=prompt_index, sample=sample, prompt=prompt, messages=messages, tools_kwargs=kwargs, tag=tag
        )

    @property
    def key(self) -> str:
        return f"{self.tag}{self.prompt_index}-{self.sample}"

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


def response_from_dict(state: dict) -> Response:
    """A ``Response`` or ``Conversation`` from its ``dataclasses.asdict`` (a checkpoint's buffer)."""
    return Conversation(**state) if "messages" in state else Response(**state)


@dataclass
class RolloutBatch:
    """A generated batch, padded, ``B = num_prompts × n`` rows in prompt order (a prompt's n responses contiguous).

    Shapes: ``P`` is the longest prompt in the batch, ``T`` the longest response in the batch (not the configured
    ``max_response_length``: shorter batches cost less in the training forward) unless ``build_rollout_batch`` is
    given ``response_length``.

    * ``prompts[B, P]`` left-padded with the pad id, ``prompt_mask[B, P]`` 1 on real tokens;
    * ``responses[B, T]`` right-padded, ``response_mask[B, T]``;
    * ``rollout_log_probs[B, T]``: vLLM's log-prob of each sampled token (0 on padding);
    * ``response_lengths[B]``, ``truncated[B]`` (stopped by the length limit, vLLM's ``finish_reason == "length"``);
    * ``input_ids = cat(prompts, responses)``, ``attention_mask = cat(prompt_mask, response_mask)``,
      ``position_ids = clamp(cumsum(attention_mask) - 1, min=0)``: the first real prompt token is position 0, as in
      vLLM, so a Megatron recompute over the padded row sees the positions the rollout used;
    * ``prompt_index[B]``: the index (into the ``generate`` call's prompt list) of each row's prompt.
    """

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_index: torch.Tensor
    # Routing replay only: the experts vLLM routed each token to, as the TrainBatch fields ``prompt_routed_experts``
    # ``[B, P, L_moe, K]`` and ``response_routed_experts`` ``[B, T, L_moe, K]`` (rollout/routing.py).
    routed_experts: Optional[dict[str, torch.Tensor]] = None
    # Partial rollout only: the policy version (training step whose weights the engine held) of each response token,
    # ``[B, T]`` int64, 0 on padding (rollout/partial.py).
    token_versions: Optional[torch.Tensor] = None
    # Multi-turn only (rollout/multi_turn.py): ``loss_mask[B, T]`` 1 on the tokens the model sampled, 0 on tool
    # output and template tokens (their rollout log-prob is 0); ``turns`` per row: the conversation for the reward
    # (``messages``), ``num_turns`` (assistant turns), ``tool_calls`` and the tools' step rewards (``tool_rewards``).
    loss_mask: Optional[torch.Tensor] = None
    turns: Optional[list[dict]] = None

    def __len__(self) -> int:
        return int(self.responses.shape[0])


def build_rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    truncated: Sequence[bool],
    prompt_index: Sequence[int],
    pad_token_id: int,
    response_length: Optional[int] = None,
) -> RolloutBatch:
    """Pad ragged rollout results into a ``RolloutBatch``.

    ``prompts`` are the distinct prompts (indexed by ``prompt_index``); ``responses``/``log_probs``/``truncated``
    have one entry per row. ``response_length`` fixes ``T`` (it must cover the longest response); by default ``T``
    is the longest response (at least 1, so tensors never have a zero-sized time dimension).
    """
    rows = len(responses)
    if not (len(log_probs) == len(truncated) == len(prompt_index) == rows):
        raise ValueError(
            f"build_rollout_batch: responses ({rows}), log_probs ({len(log_probs)}), truncated ({len(truncated)})"
            f" and prompt_index ({len(prompt_index)}) must have the same length"
        )
    for i, (resp, lp) in enumerate(zip(responses, log_probs)):
        if len(resp) != len(lp):
            raise ValueError(f"row {i}: {len(resp)} response tokens but {len(lp)} log-probs")
    longest = max((len(r) for r in responses), default=0)
    t = max(longest, 1) if response_length is None else response_length
    if t < longest:
        raise ValueError(f"response_length={response_length} is shorter than the longest response ({longest} tokens)")
    index = torch.as_tensor(list(prompt_index), dtype=torch.long).reshape(rows)
    # Whole-batch tensor ops, no per-row ones: the prompts referenced, left-padded once, then picked per row; the
    # responses' tokens and log-probs, flattened in row order, into each row's first len(response) positions.
    used = sorted(set(prompt_index))
    empty = [j for j in used if len(prompts[j]) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty; every prompt needs at least one token")
    prompt_lengths = torch.zeros(len(prompts) if used else 0, dtype=torch.long)
    prompt_lengths[used] = torch.as_tensor([len(prompts[j]) for j in used], dtype=torch.long)
    p = int(prompt_lengths.max()) if used else 1
    distinct = torch.full((len(prompt_lengths), p), pad_token_id, dtype=torch.long)
    distinct_mask = torch.arange(p) >= p - prompt_lengths[:, None]
    distinct[distinct_mask] = torch.as_tensor([tok for j in used for tok in prompts[j]], dtype=torch.long)
    prompt_t, prompt_mask = distinct[index], distinct_mask[index].long()

    lengths = torch.as_tensor([len(r) for r in responses], dtype=torch.long).reshape(rows)
    filled = torch.arange(t) < lengths[:, None]
    resp_t = torch.full((rows, t), pad_token_id, dtype=torch.long)
    resp_t[filled] = torch.as_tensor([tok for r in responses for tok in r], dtype=torch.long)
    lp_t = torch.zeros((rows, t), dtype=torch.float32)
    lp_t[filled] = torch.as_tensor([x for lp in log_probs for x in lp], dtype=torch.float32)
    resp_mask = filled.long()

    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return RolloutBatch(
        prompts=prompt_t,
        prompt_mask=prompt_mask,
        responses=resp_t,
        response_mask=resp_mask,
        rollout_log_probs=lp_t,
        response_lengths=resp_mask.sum(dim=1),
        truncated=torch.as_tensor(list(truncated), dtype=torch.bool).reshape(rows),
        input_ids=torch.cat([prompt_t, resp_t], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        prompt_index=index,
    )


def batch_of_rows(prompts: Sequence[Sequence[int]], rows: Sequence[tuple], pad_token_id: int) -> RolloutBatch:
    """``build_rollout_batch`` of gathered rows ``(prompt index, sample index, tokens, log-probs, truncated, ...)``."""
    return build_rollout_batch(
        prompts,
        responses=[r[2] for r in rows],
        log_probs=[r[3] for r in rows],
        truncated=[r[4] for r in rows],
        prompt_index=[r[0] for r in rows],
        pad_token_id=pad_token_id,
    )


def attach_turns(batch: RolloutBatch, convs: Sequence[Conversation]) -> RolloutBatch:
    """A multi-turn batch's ``loss_mask`` and ``turns`` from its rows' conversations (one per row, in row order)."""
    mask = torch.zeros_like(batch.response_mask)
    for row, c in enumerate(convs):
        mask[row, : len(c.loss_mask)] = torch.as_tensor(c.loss_mask, dtype=mask.dtype)
    batch.loss_mask, batch.turns = mask, [c.info() for c in convs]
    return batch


# One generated response: (prompt index, sample index, tokens, log-probs, truncated, routing). The routing (routing
# replay only) is ``[prompt + response tokens, MoE layers, top-k]`` or None; rows without it may have five items.
Row = tuple[int, int, list[int], list[float], bool, Optional[torch.Tensor]]

# Where a rollout reports the responses that ended in each engine step, possibly none, as (prompt index, sample index,
# response tokens, the conversation's ``Conversation.info()`` in a multi-turn rollout else None): the ``on_step`` of
# ``RolloutEngine.generate`` and ``MultiTurnRollout.generate``, which scores the rollout while the engine generates.
FinishedSink = Callable[[list[tuple[int, int, list[int], Optional[dict]]]], None]


def pack_rows(rows: Sequence[Union[Row, tuple]]) -> tuple[torch.Tensor, ...]:
    """Rows → (meta[n, 5] = prompt, sample, length, truncated, routed tokens; tokens; log-probs; routing or an empty
    tensor), compact CPU tensors."""
    routings = [r[5] if len(r) > 5 else None for r in rows]
    meta = torch.tensor(
        [[r[0], r[1], len(r[2]), int(r[4]), 0 if x is None else x.shape[0]] for r, x in zip(rows, routings)],
        dtype=torch.long,
    ).reshape(-1, 5)
    tokens = torch.tensor([tok for r in rows for tok in r[2]], dtype=torch.long)
    logprobs = torch.tensor([lp for r in rows for lp in r[3]], dtype=torch.float32)
    present = [x for x in routings if x is not None]
    routing = torch.cat(present) if present else torch.empty(0, dtype=torch.int16)
    return meta, tokens, logprobs, routing


def unpack_rows(packed: tuple[torch.Tensor, ...]) -> list[Row]:
    """``pack_rows`` inverted: six-item rows, routing None where the row had none."""
    meta, tokens, logprobs, routing = packed
    out, offset, r_offset = [], 0, 0
    toks, lps = tokens.tolist(), logprobs.tolist()
    for i, j, length, trunc, routed in meta.tolist():
        row_routing = routing[r_offset : r_offset + routed] if routed else None
        out.append((i, j, toks[offset : offset + length], lps[offset : offset + length], bool(trunc), row_routing))
        offset += length
        r_offset += routed
    return out
