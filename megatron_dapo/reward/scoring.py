"""The reward manager's scoring rules, as pure functions (values in, values out; no processes, no config checks).

* which scorer a response's ``data_source`` routes to (:func:`route_data_source`, :func:`route`);
* the custom functions a ``reward`` section names (:func:`custom_specs`; combined with their weights by
  :func:`megatron_dapo.reward.custom.build_reward_function`) and a scorer's label in messages (:func:`scorer_label`);
* a batch: its checks (:func:`check_batch`), valid lengths, a response's text (:func:`decode_response`), DAPO
  overlong shaping and the ``overlong`` (truncated) flag;
* a scorer's outcome as a row: the scorer's own row (checked: :func:`check_row`) or ``reward.error_score`` with
  ``acc`` False for a failed call (:func:`outcome_row`);
* the :class:`RewardResult` of a batch (:func:`build_result`: the final reward on the last valid token, checked
  finite) and of a batch scored in shards (:func:`merge_results`).

Where scorers run (worker pool or this process), their time limits and how failures are counted and logged is
:mod:`megatron_dapo.reward.workers`; :class:`megatron_dapo.reward.manager.RewardManager` composes the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dapo.config import ConfigError, OverlongBufferConfig, RewardConfig, extra_function_spec
from megatron_dapo.reward import custom
from megatron_dapo.reward.overlong import overlong_penalty

__all__ = [
    "MATH_DAPO_SOURCES",
    "RewardInvariantError",
    "RewardResult",
    "build_result",
    "check_batch",
    "check_row",
    "custom_specs",
    "decode_response",
    "merge_results",
    "outcome_row",
    "overlong_shaping",
    "route",
    "route_data_source",
    "scorer_label",
    "truncated_rows",
    "valid_lengths",
]

MATH_DAPO_SOURCES: tuple[str, ...] = ("math_dapo", "math", "math_dapo_reasoning")


class RewardInvariantError(RuntimeError):
    """The reward manager was about to return a non-finite reward: a bug in this module, not in a scorer."""


# ------------------------------------------------------------------------------------------- routing


def route_data_source(data_source: str) -> str:
    """``"math_dapo"`` for the built-in math sources (and ``aime*``), else ``"custom"``."""
    if data_source in MATH_DAPO_SOURCES or str(data_source).startswith("aime"):
        return "math_dapo"
    return "custom"


def route(data_sources: Sequence[str], has_custom_function: bool) -> list[str]:
    """The scorer kind of every response (:func:`route_data_source`).

    Raises:
        ConfigError: some data sources need a custom function and none is configured (the message names them and
            ``reward.custom_function.path``).
    """
    kinds = [route_data_source(ds) for ds in data_sources]
    if "custom" in kinds and not has_custom_function:
        missing = sorted({str(ds) for ds, k in zip(data_sources, kinds, strict=True) if k == "custom"})
        raise ConfigError(
            f"no reward function for data_source {', '.join(repr(m) for m in missing)}: the built-in scorer "
            f"handles {', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and "
            "reward.custom_function.name) to a Python file defining "
            "compute_score(data_source, solution_str, ground_truth, extra_info)"
        )
    return kinds


def custom_specs(config: RewardConfig) -> list[custom.RewardSpec]:
    """``[(path, name, weight), ...]`` of ``reward.custom_function`` and ``reward.extra_functions``, for a section
    that passed the config rules (malformed entries: :func:`megatron_dapo.config.rules.reward_value_problems`)."""
    specs: list[custom.RewardSpec] = []
    cf = config.custom_function
    if cf.path:
        specs.append((cf.path, cf.name, float(cf.weight)))
    for i, item in enumerate(config.extra_functions):
        spec, _ = extra_function_spec(item, f"reward.extra_functions[{i}]")
        if spec is not None:
            path, name, weight = spec
            specs.append((path, name, float(weight)))
    return specs


def scorer_label(kind: str, custom_fn: custom.CombinedRewardFunction | None) -> str:
    """How messages name the scorer of ``kind``: ``math_dapo``, or the custom function(s) (``path:name``)."""
    if kind == "math_dapo":
        return custom.MATH_DAPO_LABEL
    return kind if custom_fn is None else custom_fn.describe()


# ------------------------------------------------------------------------------------------- the batch


def check_batch(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    data_sources: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None,
) -> Sequence[dict | None]:
    """Check the shapes and lengths of a batch; returns ``extra_infos`` (all None when not given)."""
    if responses.dim() != 2 or responses.shape != response_mask.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} must both be [B, T]"
        )
    batch = responses.shape[0]
    if extra_infos is None:
        extra_infos = [None] * batch
    for name, seq in (
        ("data_sources", data_sources),
        ("ground_truths", ground_truths),
        ("extra_infos", extra_infos),
    ):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries, responses has {batch} rows")
    return extra_infos


def valid_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` valid length of each row of a ``[B, T]`` mask: its last valid index + 1 (0 for none)."""
    mask = response_mask.detach().to("cpu").bool()
    batch, width = mask.shape
    if not width:
        return torch.zeros(batch, dtype=torch.long)
    positions = torch.arange(1, width + 1).expand(batch, width)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=-1)


def decode_response(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """A response's text, special tokens skipped and a trailing ``tokenizer.eos_token`` string removed (verl)."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    eos_text = getattr(tokenizer, "eos_token", None)
    if isinstance(eos_text, str) and eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)]
    return text


def overlong_shaping(
    lengths: torch.Tensor, max_response_length: int, overlong_buffer: OverlongBufferConfig
) -> torch.Tensor:
    """``[B]`` float64 DAPO overlong penalty (zeros when ``reward.overlong_buffer`` is off)."""
    ob = overlong_buffer
    if not ob.enable:
        return torch.zeros(len(lengths), dtype=torch.float64)
    return overlong_penalty(lengths, max_response_length, ob.len, ob.penalty_factor, torch.float64)


def truncated_rows(
    ids: torch.Tensor, lengths: torch.Tensor, max_response_length: int, eos_token_ids: frozenset[int] | None
) -> torch.Tensor:
    """``[B]`` bool: the response has ``max_response_length`` tokens and (when EOS ids are known) does not end
    with EOS."""
    truncated = lengths >= max_response_length
    if eos_token_ids is not None and ids.shape[1] and bool(truncated.any()):
        last = ids.gather(1, (lengths.long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # each row's last token
        truncated &= ~torch.isin(last, torch.tensor(sorted(eos_token_ids), dtype=ids.dtype))
    return truncated


# ------------------------------------------------------------------------------------------- rows and results


def check_row(row: Any, index: int) -> None:
    """The invariant of every "ok" scorer outcome (see :func:`megatron_dapo.reward.custom.normalise_result`)."""
    score = row.get("score") if isinstance(row, dict) else None
    if type(score) is not float or not math.isfinite(score):
        raise RewardInvariantError(
            f"internal error in megatron_dapo/reward/scoring.py: response {index} was scored ok with a row that is "
            f"not a dict with a finite float 'score': {custom.short_repr(row)}"
        )


def outcome_row(outcome: custom.Outcome, index: int, error_score: float) -> dict[str, Any]:
    """Response ``index``'s row: the scorer's (checked) row when it succeeded, else ``{"score": error_score,
    "acc": False}``."""
    status, payload = outcome
    if status != "ok":
        return {"score": float(error_score), "acc": False}
    row, _note = payload
    check_row(row, index)
    return row


@dataclass
class RewardResult:
    """Rewards of a batch of ``B`` responses of width ``T``.

    Attributes:
        token_level_scores: ``[B, T]`` float32, zero except the final reward on the last valid response token
            (position ``T - 1`` for an empty response, like verl's ``[-1]`` index).
        scores: ``[B]`` float32 final rewards (scorer score + overlong shaping).
        extra: per-response lists of length ``B``: ``score`` (the scorer's score, before shaping), ``acc`` (bool,
            or None when the scorer gave none and its score was not 0 or 1; False for a failed call),
            ``overlong_reward`` (0.0 when shaping is off), ``overlong`` (the response was truncated at
            ``max_response_length``: use it for ``reward.overlong_filter``), and the scorer's other dict keys
            (``pred`` for math_dapo); missing values are None.
        metrics: ``reward/num_errors``, ``reward/num_timeouts``, ``reward/num_overlong``, ``reward/score_mean``.
        response_lengths: ``[B]`` int64 valid lengths (last valid index + 1).
        overlong: ``[B]`` bool, same as ``extra["overlong"]``.
    """

    token_level_scores: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    response_lengths: torch.Tensor | None = None
    overlong: torch.Tensor | None = None


def build_result(
    rows: list[dict[str, Any]],
    lengths: torch.Tensor,
    shaping: torch.Tensor,
    truncated: torch.Tensor,
    width: int,
    failures: tuple[int, int],
) -> RewardResult:
    """The :class:`RewardResult` of a batch: final reward = row score + ``shaping``, on the last valid token.

    Args:
        rows: one per response (:func:`outcome_row`).
        lengths, shaping, truncated: ``[B]`` (:func:`valid_lengths`, :func:`overlong_shaping`,
            :func:`truncated_rows`).
        width: ``T``.
        failures: ``(num_errors, num_timeouts)``.
    """
    final = (torch.tensor([r["score"] for r in rows], dtype=torch.float64) + shaping).to(torch.float32)
    token_level_scores = _on_last_token(final, lengths, width)
    _check_finite(final, token_level_scores, rows, shaping)
    num_errors, num_timeouts = failures
    metrics = {
        "reward/num_errors": float(num_errors),
        "reward/num_timeouts": float(num_timeouts),
        "reward/num_overlong": float(truncated.sum().item()),
        "reward/score_mean": float(final.mean().item()) if len(rows) else 0.0,
    }
    return RewardResult(
        token_level_scores=token_level_scores,
        scores=final,
        extra=_extra_columns(rows, shaping, truncated),
        metrics=metrics,
        response_lengths=lengths.to(torch.long),
        overlong=truncated,
    )


def merge_results(parts: Sequence[tuple[Sequence[int], RewardResult]], batch_size: int) -> RewardResult:
    """One ``RewardResult`` for a batch scored in shards: ``parts`` are ``(rows, result of those rows)`` covering
    every row of ``range(batch_size)`` once. Counts add up; ``reward/score_mean`` is over the whole batch."""
    first = parts[0][1]
    width = first.token_level_scores.shape[1]
    token_level = torch.zeros(batch_size, width, dtype=first.token_level_scores.dtype)
    scores = torch.zeros(batch_size, dtype=first.scores.dtype)
    lengths = torch.zeros(batch_size, dtype=torch.long)
    overlong = torch.zeros(batch_size, dtype=torch.bool)
    extra: dict[str, list] = {}
    metrics: dict[str, float] = {}
    seen = 0
    for rows, result in parts:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        seen += len(index)
        token_level[index] = result.token_level_scores
        scores[index] = result.scores
        if result.response_lengths is not None:
            lengths[index] = result.response_lengths
        if result.overlong is not None:
            overlong[index] = result.overlong
        for key, values in result.extra.items():
            column = extra.setdefault(key, [None] * batch_size)
            for row, value in zip(rows, values):
                column[row] = value
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    if seen != batch_size:
        raise ValueError(f"merge_results: the parts cover {seen} rows, the batch has {batch_size}")
    metrics["reward/score_mean"] = float(scores.mean().item()) if batch_size else 0.0
    return RewardResult(token_level, scores, extra, metrics, lengths, overlong)


def _on_last_token(final: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` float32 zeros with ``final[i]`` on row ``i``'s last valid token (``T - 1`` for an empty one)."""
    batch = len(final)
    token_level_scores = torch.zeros(batch, width, dtype=torch.float32)
    if width:
        last = torch.where(lengths > 0, lengths - 1, torch.full_like(lengths, width - 1))
        token_level_scores[torch.arange(batch), last] = final
    return token_level_scores


def _check_finite(
    final: torch.Tensor, token_level_scores: torch.Tensor, rows: list[dict[str, Any]], shaping: torch.Tensor
) -> None:
    """Raise :class:`RewardInvariantError` if a final reward is not finite (a bug: scorer results are checked)."""
    if bool(torch.isfinite(final).all()) and bool(torch.isfinite(token_level_scores).all()):
        return
    bad = torch.nonzero(~torch.isfinite(final)).flatten().tolist()
    raise RewardInvariantError(
        f"internal error in megatron_dapo/reward/scoring.py: non-finite final rewards for responses {bad} "
        f"(scores {[rows[i]['score'] for i in bad]}, overlong shaping {[float(shaping[i]) for i in bad]}); "
        "every scorer result is checked before this point, so this is a bug here"
    )


def _extra_columns(rows: list[dict[str, Any]], shaping: torch.Tensor, truncated: torch.Tensor) -> dict[str, list]:
    """``RewardResult.extra``: ``score``, ``acc``, the scorers' other keys (first seen first, None where missing),
    ``overlong_reward`` and ``overlong``."""
    keys: list[str] = ["score", "acc"]
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    extra: dict[str, list] = {k: [row.get(k) for row in rows] for k in keys}
    extra["overlong_reward"] = shaping.tolist()
    extra["overlong"] = truncated.tolist()
    return extra
