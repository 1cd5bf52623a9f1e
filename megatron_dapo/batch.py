"""The data of a training step, declared: ``TrainBatch`` (a scored batch, built once after scoring and passed down to
dynamic sampling, advantages, the actor and metrics) and ``MicroBatch`` (what one forward/backward of the actor sees).

One padding rule: in a ``TrainBatch`` prompts are left-padded to the batch's longest prompt ``P`` and responses are
right-padded to its longest response ``T``; padding holds 0 (tokens, masks and values alike). Concatenating batches
re-pads to the new longest. A micro-batch re-lays its rows left-aligned (prompt, response, then padding) and trims to
its own longest row: rotary positions then start at 0 for every row and only a causal mask is needed.

Shapes: ``B`` rows (responses; ``prompts × n``, a prompt's ``n`` responses contiguous), ``P`` prompt width, ``T``
response width. Per-token fields are ``[B, T]`` float32 unless stated; per-row fields ``[B]``. A per-token field may
have trailing dimensions (the rollout's MoE routing: ``[B, P, L, K]`` / ``[B, T, L, K]``); padding rules apply to
dimension 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = [
    "MicroBatch",
    "TrainBatch",
    "context_parallel_slice",
    "make_micro_batch",
    "pack_micro_batch",
    "padded_seq_len",
]

# How each TrainBatch field is laid out, for select/concat (dataclass field metadata "layout").
_PROMPT = {"layout": "prompt"}  # [B, P], left-padded
_RESPONSE = {"layout": "response"}  # [B, T], right-padded
_ROW = {"layout": "row"}  # [B] tensor
_LIST = {"layout": "list"}  # list of length B


@dataclass
class TrainBatch:
    """A step's batch. The rollout fields and rewards are set by ``DAPOTrainer.score``; the others by the phase named.

    Fields that a phase has not produced yet are None; the actor and the loss read only what they need.
    """

    # --- tokens (rollout)
    prompts: torch.Tensor = field(metadata=_PROMPT)  # [B, P] int64
    prompt_mask: torch.Tensor = field(metadata=_PROMPT)  # [B, P] 1 on prompt tokens
    responses: torch.Tensor = field(metadata=_RESPONSE)  # [B, T] int64
    response_mask: torch.Tensor = field(metadata=_RESPONSE)  # [B, T] 1 on generated tokens
    # Tokens that enter the loss and its normalisers: response_mask without overlong-filtered rows
    # (reward.overlong_filter) and without the filler rows of an exhausted dynamic-sampling step. Default: a copy of
    # response_mask.
    loss_mask: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    # Multi-turn rollout: 1 on the tokens the model sampled, 0 on tool turns (rollout/multi_turn.py); None = every
    # response token was sampled. ``model_mask`` is what advantages and the rollout-mismatch metrics read.
    sampled_mask: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    rollout_log_probs: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)  # the engine's, per token
    # The rollout engine's MoE routing (actor.router_replay=rollout): for every token, in each of the model's L MoE
    # layers (in layer order, dense layers left out), the K experts it was routed to. Integer [B, P, L, K] (prompt
    # tokens, left-padded) and [B, T, L, K] (response tokens); padding and tokens the engine never ran (the last
    # response token) may hold anything (rollout/routing.py, actor/router_replay.py).
    prompt_routed_experts: Optional[torch.Tensor] = field(default=None, metadata=_PROMPT)
    response_routed_experts: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    truncated: Optional[torch.Tensor] = field(default=None, metadata=_ROW)  # [B] bool: stopped by the length limit
    # Partial rollout: the policy version (the training step whose weights generated it) of each response token,
    # [B, T] int64; None when every token comes from the weights being updated (synchronous rollout).
    token_versions: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    # --- rewards (scoring)
    token_level_scores: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)  # reward on the last token
    seq_rewards: Optional[torch.Tensor] = field(default=None, metadata=_ROW)  # [B] final reward (= scores' row sum)
    verifier_scores: Optional[torch.Tensor] = field(default=None, metadata=_ROW)  # [B] the reward function's score
    acc: Optional[torch.Tensor] = field(default=None, metadata=_ROW)  # [B] 1.0 when the verifier says correct
    # GDPO: the reward function's reward dimensions named by algorithm.gdpo_reward_keys, [B, K] (0 where a call failed)
    reward_components: Optional[torch.Tensor] = field(default=None, metadata=_ROW)
    # ReMax: the reward of the greedy response to each row's prompt, [B] (training/rollout_phase.py)
    reward_baselines: Optional[torch.Tensor] = field(default=None, metadata=_ROW)
    data_source: Optional[list[str]] = field(default=None, metadata=_LIST)
    prompt_text: Optional[list[str]] = field(default=None, metadata=_LIST)  # only when rollouts are dumped
    response_text: Optional[list[str]] = field(default=None, metadata=_LIST)
    # --- dynamic sampling
    group_ids: Optional[list[Hashable]] = field(default=None, metadata=_LIST)  # the prompt (group) of each row
    filler: Optional[torch.Tensor] = field(default=None, metadata=_ROW)  # [B] bool: exhausted-step filler rows
    # --- log-probs (Megatron forwards)
    old_log_probs: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)  # None on the on-policy path
    # The optimal-token-baseline estimators: Σ_v π_old(v)² at each response token (algo/logprobs.py)
    sum_pi_squared: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    ref_log_probs: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    # On-policy distillation: the routed teacher's log-prob of each response token (distill/teacher.py)
    teacher_log_probs: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    # --- advantages
    token_level_rewards: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)  # scores - KL (in reward)
    advantages: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    returns: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)
    rollout_is_weights: Optional[torch.Tensor] = field(default=None, metadata=_RESPONSE)  # truncated IS weights

    @property
    def model_mask(self) -> torch.Tensor:
        """The response tokens the model sampled (all of them unless a multi-turn rollout added tool turns)."""
        return self.response_mask if self.sampled_mask is None else self.sampled_mask

    def __post_init__(self) -> None:
        rows, width = self.responses.shape
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.clone()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            layout = f.metadata["layout"]
            size = len(value) if layout == "list" else int(value.shape[0])
            if size != rows:
                raise ValueError(f"TrainBatch.{f.name} has {size} rows, responses has {rows}")
            expected = {"response": (rows, width), "prompt": tuple(self.prompts.shape)}.get(layout)
            if expected is not None and tuple(value.shape[:2]) != expected:
                raise ValueError(f"TrainBatch.{f.name} has shape {tuple(value.shape)}, expected {expected}")

    def __len__(self) -> int:
        return int(self.responses.shape[0])

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """``[B]`` prompt + response tokens of each row."""
        return self.prompt_mask.sum(-1) + self.response_mask.sum(-1)

    def select(self, rows: Sequence[int] | torch.Tensor | slice) -> TrainBatch:
        """Rows ``rows`` (in that order) of every field; widths are kept."""
        if isinstance(rows, slice):
            rows = range(*rows.indices(len(self)))
        index = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows, dtype=torch.long)
        picked: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                picked[f.name] = [value[i] for i in index.tolist()] if f.metadata["layout"] == "list" else value[index]
        return TrainBatch(**picked)

    @classmethod
    def concat(cls, parts: Sequence[TrainBatch]) -> TrainBatch:
        """Rows of ``parts`` one after the other, re-padded to the longest prompt and response. A field is kept only
        when every part has it."""
        if not parts:
            raise ValueError("TrainBatch.concat needs at least one batch")
        prompt_width = max(int(p.prompts.shape[1]) for p in parts)
        response_width = max(int(p.responses.shape[1]) for p in parts)
        joined: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if any(v is None for v in values):
                continue
            layout = f.metadata["layout"]
            if layout == "list":
                joined[f.name] = [x for v in values for x in v]
            elif layout == "row":
                joined[f.name] = torch.cat(values)
            else:
                width = prompt_width if layout == "prompt" else response_width
                joined[f.name] = torch.cat([_pad_to(v, width, left=layout == "prompt") for v in values])
        return cls(**joined)


def _pad_to(t: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """``t`` padded with 0 along dimension 1 to ``width`` (on the left or the right)."""
    extra = width - int(t.shape[1])
    trailing = (0, 0) * (t.dim() - 2)  # F.pad lists dimensions last first
    return t if extra == 0 else torch.nn.functional.pad(t, trailing + ((extra, 0) if left else (0, extra)))


def _gather_positions(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[row, index[row, j], ...]`` for a ``[b, W, ...]`` tensor and a ``[b, S]`` index: ``[b, S, ...]``."""
    shape = (*index.shape, *t.shape[2:])
    return t.gather(1, index.reshape(*index.shape, *([1] * (t.dim() - 2))).expand(shape))


@dataclass
class MicroBatch:
    """One forward/backward's rows, re-laid left-aligned: ``tokens[b, S]`` = prompt, response, then 0s.

    The logit at position ``j`` predicts token ``j + 1``, so response token ``t`` of a row is predicted at
    ``response_index[row, t] = prompt_len - 1 + t``. Per-token loss inputs keep the batch's ``[b, T]`` layout.
    """

    tokens: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    response_index: torch.Tensor  # [b, T]
    response_tokens: torch.Tensor  # [b, T]
    response_mask: torch.Tensor  # [b, T] bool
    loss_mask: torch.Tensor  # [b, T]
    # Multi-turn: [b, T] bool, the response tokens the model sampled (tool turns are not); None = all of them.
    sampled_mask: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None  # [b, S] True on padding tokens (MoE routers leave them out)
    # The rollout's MoE routing laid out like tokens: [b, S, L, K] (packed: [1, N, L, K]); 0 on padding.
    routed_experts: Optional[torch.Tensor] = None
    # Packed (THD) layout, set by ``pack_micro_batch``: tokens are [1, N], rows one after the other; row i spans
    # cu_seqlens_padded[i]:cu_seqlens_padded[i + 1] with its cu_seqlens[i + 1] - cu_seqlens[i] real tokens first.
    cu_seqlens: Optional[torch.Tensor] = None  # [b + 1] int32
    cu_seqlens_padded: Optional[torch.Tensor] = None  # [b + 1] int32
    max_seqlen: Optional[int] = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def to(self, device: torch.device | str) -> MicroBatch:
        def moved(value):
            return value.to(device) if isinstance(value, torch.Tensor) else value

        return MicroBatch(**{f.name: moved(getattr(self, f.name)) for f in dataclasses.fields(self)})


def padded_seq_len(longest: int, seq_multiple: int) -> int:
    """``longest`` rounded up to a multiple of ``seq_multiple`` (sequence parallelism splits the sequence over TP)."""
    return -(-longest // seq_multiple) * seq_multiple


def make_micro_batch(batch: TrainBatch, rows: Sequence[int], seq_multiple: int = 1) -> MicroBatch:
    """Rows ``rows`` of ``batch``, re-laid left-aligned and trimmed to their longest (rounded to ``seq_multiple``)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    prompts, prompt_mask = batch.prompts[index], batch.prompt_mask[index].bool()
    responses, response_mask = batch.responses[index], batch.response_mask[index].bool()
    b, t = responses.shape
    width = prompts.shape[1]
    prompt_lens = prompt_mask.sum(-1, keepdim=True)
    total_lens = prompt_lens + response_mask.sum(-1, keepdim=True)
    seq_len = padded_seq_len(int(total_lens.max()), seq_multiple)
    pos = torch.arange(seq_len).unsqueeze(0)
    # Position j holds prompt token width - prompt_len + j (left padding) or response token j - prompt_len.
    from_prompt = prompts.gather(1, (width - prompt_lens + pos).clamp(0, width - 1))
    from_response = responses.gather(1, (pos - prompt_lens).clamp(0, t - 1))
    tokens = torch.where(pos < prompt_lens, from_prompt, torch.where(pos < total_lens, from_response, 0))

    def rows_of(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if value is None else value[index]

    routed = None
    if batch.prompt_routed_experts is not None and batch.response_routed_experts is not None:
        from_prompt = _gather_positions(
            batch.prompt_routed_experts[index], (width - prompt_lens + pos).clamp(0, width - 1)
        )
        from_response = _gather_positions(batch.response_routed_experts[index], (pos - prompt_lens).clamp(0, t - 1))
        at = (..., None, None)
        routed = torch.where(
            (pos < prompt_lens)[at], from_prompt, torch.where((pos < total_lens)[at], from_response, 0)
        )

    return MicroBatch(
        tokens=tokens,
        position_ids=pos.expand(b, -1).contiguous(),
        padding_mask=pos >= total_lens,
        response_index=(prompt_lens - 1 + torch.arange(t).unsqueeze(0)).clamp(max=seq_len - 1),
        response_tokens=responses,
        response_mask=response_mask,
        loss_mask=batch.loss_mask[index],
        sampled_mask=None if batch.sampled_mask is None else batch.sampled_mask[index].bool() & response_mask,
        advantages=rows_of(batch.advantages),
        old_log_probs=rows_of(batch.old_log_probs),
        ref_log_probs=rows_of(batch.ref_log_probs),
        teacher_log_probs=rows_of(batch.teacher_log_probs),
        rollout_log_probs=rows_of(batch.rollout_log_probs),
        rollout_is_weights=rows_of(batch.rollout_is_weights),
        routed_experts=routed,
    )


def context_parallel_slice(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This context-parallel rank's part of a micro-batch, as megatron-core splits sequences for causal attention.

    The sequence (its length a multiple of ``2 * cp_size``: ``make_micro_batch(seq_multiple=...)``) is cut into
    ``2 * cp_size`` chunks and rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``, so every rank gets the same
    share of causal-attention work (megatron-core's ``get_batch_on_this_cp_rank``); the attention (TransformerEngine,
    MindSpeed) exchanges keys and values, and rotary positions follow the kept chunks. ``response_index`` is mapped
    into the local sequence, and ``response_mask``/``loss_mask`` keep only the response tokens predicted at a local
    position: summed over the CP ranks, per-token sums (loss, metrics, log-probs) are those of the whole sequence.
    """
    if cp_size == 1:
        return mb
    seq_len = int(mb.tokens.shape[1])
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context_parallel_size={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    kept = (cp_rank, 2 * cp_size - 1 - cp_rank)
    positions = torch.cat([torch.arange(k * chunk, (k + 1) * chunk) for k in kept])
    which_chunk = mb.response_index // chunk
    first, second = which_chunk == kept[0], which_chunk == kept[1]
    local_index = torch.where(second, mb.response_index % chunk + chunk, mb.response_index % chunk)
    owned = first | second
    return dataclasses.replace(
        mb,
        tokens=mb.tokens[:, positions],
        position_ids=mb.position_ids[:, positions],
        padding_mask=mb.padding_mask[:, positions],
        routed_experts=None if mb.routed_experts is None else mb.routed_experts[:, positions],
        response_index=torch.where(owned, local_index, 0),
        response_mask=mb.response_mask & owned,
        loss_mask=mb.loss_mask * owned.to(mb.loss_mask.dtype),
        sampled_mask=None if mb.sampled_mask is None else mb.sampled_mask & owned,
    )


def pack_micro_batch(mb: MicroBatch, row_multiple: int = 1, total_multiple: int = 1) -> MicroBatch:
    """The micro-batch without padding (THD layout for TransformerEngine / MindSpeed attention): its rows' real
    tokens one after the other in ``tokens[1, N]``, each row padded to a multiple of ``row_multiple`` and the whole to
    a multiple of ``total_multiple`` (sequence parallelism splits N over TP); positions restart at 0 in every row.
    ``response_index`` points into the packed sequence; ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded``
    (the layout) tell the attention where rows start."""
    if mb.packed:
        return mb
    b, seq_len = mb.tokens.shape
    lengths = (mb.response_index[:, 0] + 1 + mb.response_mask.sum(-1)).tolist()  # prompt_len - 1 + 1 + responses
    padded = [-(-n // row_multiple) * row_multiple for n in lengths]
    padded[-1] += -sum(padded) % total_multiple
    starts = [0]
    for n in padded:
        starts.append(starts[-1] + n)
    total = starts[-1]
    tokens = torch.zeros((1, total), dtype=mb.tokens.dtype)
    position_ids = torch.zeros((1, total), dtype=mb.position_ids.dtype)
    padding = torch.ones((1, total), dtype=torch.bool)
    routed = None
    if mb.routed_experts is not None:
        routed = mb.routed_experts.new_zeros((1, total, *mb.routed_experts.shape[2:]))
    for i, (n, start) in enumerate(zip(lengths, starts)):
        tokens[0, start : start + n] = mb.tokens[i, :n]
        if routed is not None:
            routed[0, start : start + n] = mb.routed_experts[i, :n]
        position_ids[0, start : start + n] = torch.arange(n)
        padding[0, start : start + n] = False
    offsets = torch.as_tensor(starts[:-1], dtype=mb.response_index.dtype).unsqueeze(-1)
    real = [0]
    for n in lengths:
        real.append(real[-1] + n)
    return dataclasses.replace(
        mb,
        tokens=tokens,
        position_ids=position_ids,
        padding_mask=padding,
        routed_experts=routed,
        response_index=(mb.response_index + offsets).clamp(max=total - 1),
        cu_seqlens=torch.as_tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.as_tensor(starts, dtype=torch.int32),
        max_seqlen=max(padded),
    )
