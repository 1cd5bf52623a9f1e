"""Per-step metrics under verl's names (``verl/trainer/ppo/metric_utils.py``), computed from a step's
``TrainBatch`` (``megatron_dapo/batch.py``). Pure functions: no process groups, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

from megatron_dapo.batch import TrainBatch

# Sections whose time is normalised per token, and by which tokens (verl's table; ``old_log_prob`` added because
# it is a full forward over prompt + response, like ``ref``).
_PER_TOKEN_SECTIONS = {
    "gen": "response",
    "old_log_prob": "all",
    "ref": "all",
    "adv": "all",
    "update_actor": "all",
}


def _lengths(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt lengths, response lengths) as float tensors."""
    return batch.prompt_mask.sum(-1).float(), batch.response_mask.sum(-1).float()


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def compute_data_metrics(
    batch: TrainBatch,
    max_prompt_length: Optional[int] = None,
    max_response_length: Optional[int] = None,
) -> dict[str, float]:
    """verl's ``compute_data_metrics`` (without a critic): score/reward/advantage/return and length statistics.

    * ``critic/score/*`` and ``critic/rewards/*``: per-sequence sums of the token-level scores / rewards
      (rewards = scores after a KL penalty), over non-aborted sequences (response length > 0).
    * ``critic/advantages/*``, ``critic/returns/*``: over response tokens (``response_mask``).
    * ``response_length/*``, ``prompt_length/*``: token counts; ``clip_ratio`` = share of sequences whose length
      equals the budget (``max_*_length``, by default the padded width as in verl).
    * ``response_length_non_aborted/*`` and ``response/aborted_ratio`` as in verl.
    """
    prompt_length, response_length = _lengths(batch)
    if max_prompt_length is None:
        max_prompt_length = int(batch.prompts.shape[1])
    if max_response_length is None:
        max_response_length = int(batch.responses.shape[1])
    scores = batch.token_level_scores.sum(-1)
    rewards = (batch.token_level_rewards if batch.token_level_rewards is not None else batch.token_level_scores).sum(-1)
    response_mask = batch.model_mask.bool()

    aborted = response_length == 0
    if bool(aborted.all()):
        raise ValueError("compute_data_metrics: every response in the batch is empty (all samples aborted)")
    kept = ~aborted
    kept_length = response_length[kept]

    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", scores[kept]))
    metrics.update(_stats("critic/rewards", rewards[kept]))
    metrics.update(_stats("critic/advantages", torch.masked_select(batch.advantages, response_mask)))
    metrics.update(_stats("critic/returns", torch.masked_select(batch.returns, response_mask)))
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == max_response_length).double().mean().item()
    metrics.update(_stats("response_length_non_aborted", kept_length))
    metrics["response_length_non_aborted/clip_ratio"] = (kept_length == max_response_length).double().mean().item()
    metrics["response/aborted_ratio"] = aborted.double().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length == max_prompt_length).double().mean().item()
    return metrics


def _token_counts(batch: TrainBatch) -> tuple[int, int]:
    prompt_length, response_length = _lengths(batch)
    return int(prompt_length.sum().item()), int(response_length.sum().item())


def compute_timing_metrics(timings: Mapping[str, float], batch: TrainBatch) -> dict[str, float]:
    """``timing_s/<name>`` for every timed section and ``timing_per_token_ms/<name>`` for the sections of
    ``_PER_TOKEN_SECTIONS`` that ran: ``gen`` per response token, the others per prompt + response token."""
    num_prompt, num_response = _token_counts(batch)
    tokens = {"response": num_response, "all": num_prompt + num_response}
    out = {f"timing_s/{name}": float(value) for name, value in timings.items()}
    for name, which in _PER_TOKEN_SECTIONS.items():
        if name in timings and tokens[which] > 0:
            out[f"timing_per_token_ms/{name}"] = float(timings[name]) * 1000.0 / tokens[which]
    return out


def compute_throughput_metrics(batch: TrainBatch, timings: Mapping[str, float], n_gpus: int) -> dict[str, float]:
    """``perf/total_num_tokens`` (prompt + response tokens of the batch), ``perf/time_per_step`` (``timings['step']``)
    and ``perf/throughput`` = tokens / (time × devices), as in verl."""
    if "step" not in timings:
        raise KeyError(f"compute_throughput_metrics: timings has no 'step' entry (keys: {sorted(timings)})")
    if n_gpus < 1:
        raise ValueError(f"compute_throughput_metrics: n_gpus must be >= 1, got {n_gpus}")
    num_prompt, num_response = _token_counts(batch)
    total = num_prompt + num_response
    step_time = float(timings["step"])
    return {
        "perf/total_num_tokens": total,
        "perf/time_per_step": step_time,
        "perf/throughput": total / (step_time * n_gpus) if step_time > 0 else math.inf,
    }


def step_metrics(
    batch: TrainBatch,
    timings: Mapping[str, float],
    startup: Mapping[str, float],
    max_lengths: tuple[int, int],
    n_gpus: int,
) -> dict[str, float]:
    """verl's data, timing and throughput metrics of a finished step (``startup``: the start-up's timings, on the
    first step only; ``max_lengths``: ``data.max_prompt_length`` and ``data.max_response_length``)."""
    metrics = compute_data_metrics(batch, max_prompt_length=max_lengths[0], max_response_length=max_lengths[1])
    metrics.update(compute_timing_metrics({**timings, **startup}, batch))
    metrics.update(compute_throughput_metrics(batch, timings, n_gpus))
    return metrics


def compute_val_metrics(data_sources: list[str], accs: Iterable[float], n: int) -> dict[str, float]:
    """``val-core/<data_source>/acc/mean@<n>``: mean accuracy of the ``n`` responses per prompt, averaged over the
    prompts of each data source (every prompt has ``n`` responses, so this is the mean over that source's rows)."""
    accs = [float(a) for a in accs]
    if len(accs) != len(data_sources):
        raise ValueError(f"compute_val_metrics: {len(data_sources)} data sources but {len(accs)} accuracies")
    by_source: dict[str, list[float]] = {}
    for source, acc in zip(data_sources, accs):
        by_source.setdefault(source, []).append(acc)
    return {f"val-core/{source}/acc/mean@{n}": sum(v) / len(v) for source, v in sorted(by_source.items())}


def _reduce_op(key: str) -> str:
    # verl reduces keys containing "max"/"min" with max/min and the rest with the mean. We look at whole words of
    # the last name component only, so "timing_s/gen" (t-i-"min"-g) is averaged, "response_length/max" maxed.
    words = key.rsplit("/", 1)[-1].split("_")
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def reduce_metrics(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Combine per-micro-batch / per-mini-batch metric dicts: mean per key over the dicts that have it, except
    ``.../max``-like keys (max) and ``.../min``-like keys (min)."""
    values: dict[str, list[float]] = {}
    for item in metrics:
        for key, value in item.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"reduce_metrics: metric {key!r} is a tensor of shape {tuple(value.shape)}")
                value = value.item()
            try:
                values.setdefault(key, []).append(float(value))
            except (TypeError, ValueError):
                raise TypeError(f"reduce_metrics: metric {key!r} has a non-numeric value {value!r}") from None
    out = {}
    for key, vals in values.items():
        op = _reduce_op(key)
        out[key] = max(vals) if op == "max" else min(vals) if op == "min" else sum(vals) / len(vals)
    return out
