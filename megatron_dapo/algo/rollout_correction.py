"""verl 0.9.1's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``) as pure functions: the truncated
importance-sampling weights ``pi / pi_rollout`` (token or sequence level, TIS or IcePop, optionally normalised to
mean 1) and the rejection-sampling keep mask (``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*``), for
the ``bypass_mode`` policy loss (``algo/policy_losses.py``).

Every sequence-level quantity goes through ``row_sum`` (``PolicyLossInputs.sum_rows``: the sum over a sequence's
loss tokens, over every context-parallel rank holding part of it), so the weights and the keep mask are those of
the whole sequence under CP. ``seq_max_k*`` keeps a sequence when no token's divergence exceeds the bound, which is
the row max test written as a row sum (a count of offending tokens). Nothing here talks to a process group.

The threshold parsers raise ``ValueError`` with verl's rules; config validation (``config/rules.py``) reports their
messages under the offending key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

__all__ = [
    "IS_LEVELS",
    "LOSS_TYPES",
    "RS_OPTIONS",
    "SAFETY_BOUND",
    "parse_is_threshold",
    "parse_rs_options",
    "parse_rs_thresholds",
    "rejection_keep_mask",
    "rollout_is_weights",
]

SAFETY_BOUND = 20.0  # verl clamps log-ratios to [-20, 20] before exponentiating
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
MEAN_EPS = 1e-8  # verl's masked_mean: sum / (count + 1e-8)
NORMALISE_MIN = 1e-8  # verl normalises the IS weights only when their mean exceeds this

RowSum = Callable[[torch.Tensor], torch.Tensor]
Threshold = str | float


# ------------------------------------------------------------------------------------------------ thresholds
def _positive_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {text!r} is not a number") from exc
    if not value > 0:
        raise ValueError(f"{what}: {text!r} must be positive")
    return value


def parse_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold`` → ``(upper, lower)``: a number is TIS's upper bound (``lower`` None); a
    ``"lower_upper"`` string is IcePop's bounds (``0 < lower <= upper``)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError("a positive number (TIS upper bound) or a 'lower_upper' string (IcePop bounds)")
    if isinstance(spec, str) and "_" in spec.strip():
        lower_text, upper_text = spec.strip().split("_", 1)
        lower = _positive_float(lower_text, "IcePop lower bound")
        upper = _positive_float(upper_text, "IcePop upper bound")
        if lower > upper:
            raise ValueError(f"IcePop lower bound {lower} must be <= upper bound {upper}")
        return upper, lower
    return _positive_float(str(spec).strip(), "TIS upper bound"), None


def parse_rs_options(spec: str) -> list[str]:
    """``rollout_rs`` (comma separated) → its options, duplicates removed, in order."""
    options: list[str] = []
    for option in (part.strip() for part in str(spec).split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS:
            raise ValueError(f"unknown option {option!r}; options: {', '.join(RS_OPTIONS)}")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("at least one option is needed")
    return options


def parse_rs_thresholds(options: list[str], spec: Optional[Threshold]) -> dict[str, tuple[Optional[float], float]]:
    """``rollout_rs_threshold`` → ``{option: (lower, upper)}``: one entry shared by every option or one per option
    (comma separated). ``*_k1`` takes ``lower_upper`` ratio bounds (a single number ``u`` means ``1/u_u``); the
    other options one positive upper bound (``lower`` None)."""
    if spec is None or isinstance(spec, bool):
        raise ValueError("a threshold is required with rollout_rs")
    specs = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"one threshold for every option or exactly {len(options)} (one per rollout_rs option)")
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, tuple[Optional[float], float]] = {}
    for option, text in zip(options, specs):
        if option.endswith("k1"):
            lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
            upper = _positive_float(upper_text, f"{option} upper bound")
            lower = 1.0 / upper if lower_text is None else _positive_float(lower_text, f"{option} lower bound")
            if lower > upper:
                raise ValueError(f"{option}: lower bound {lower} must be <= upper bound {upper}")
            out[option] = (lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"{option} takes a single upper bound, not {text!r}")
            out[option] = (None, _positive_float(text, f"{option} upper bound"))
    return out


# ------------------------------------------------------------------------------------------------ IS weights
@torch.no_grad()
def rollout_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    row_sum: RowSum,
    level: str,
    threshold: Threshold,
    batch_normalize: bool = False,
) -> torch.Tensor:
    """``[B, T]`` detached IS weights from ``log_ratio = log pi - log pi_rollout`` (verl's
    ``compute_rollout_correction_weights``): ``exp(clamp(x, -20, 20))`` with ``x`` the token's log-ratio
    (``token``) or the sequence's sum (``sequence``, via ``row_sum``), 0 outside ``mask``; truncated above (TIS) or
    zeroed outside ``[lower, upper]`` (IcePop); with ``batch_normalize`` divided by their mean over the rows given
    (tokens for ``token``, sequences for ``sequence``; kept when the mean is <= 1e-8)."""
    upper, lower = parse_is_threshold(threshold)
    mask = mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        seq = torch.clamp(row_sum(log_ratio), -SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(seq).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} or null, got {level!r}")
    raw = torch.where(mask.bool(), raw, torch.zeros_like(raw)) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        counts = row_sum(torch.ones_like(weights))
        if level == "token":
            mean = row_sum(weights).sum() / (counts.sum() + MEAN_EPS)
        else:
            valid = (counts > 0).to(weights.dtype)
            seq_weights = row_sum(weights) / (counts + MEAN_EPS)
            mean = (seq_weights * valid).sum() / valid.sum().clamp_min(MEAN_EPS)
        if mean > NORMALISE_MIN:
            weights = weights / mean
    return weights.detach()


# ------------------------------------------------------------------------------------------------ rejection
def _divergence(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's per-token estimators of the clamped log-ratio ``x``: k1 ``-x``, k2 ``x^2 / 2``, k3 ``e^x - 1 - x``."""
    x = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x**2
    return torch.exp(x) - 1.0 - x


def _option_keep(option: str, log_ratio: torch.Tensor, mask: torch.Tensor, row_sum: RowSum, bounds) -> torch.Tensor:
    """``[B, T]`` bool: the tokens (``token_*``) or whole rows (``seq_*``) that pass one option."""
    lower, upper = bounds
    level, kind = option.rsplit("_", 1)
    stat = _divergence(log_ratio, kind)
    if level == "seq_max":  # max over the row <= upper  <=>  no token of the row above upper
        above = torch.where(mask.bool(), (stat > upper).to(stat.dtype), torch.zeros_like(stat))
        return (row_sum(above) == 0).unsqueeze(-1).expand_as(stat)
    if level == "seq_sum":
        stat = row_sum(stat).unsqueeze(-1).expand_as(log_ratio)
    elif level == "seq_mean":
        stat = (row_sum(stat) / (row_sum(torch.ones_like(stat)) + MEAN_EPS)).unsqueeze(-1).expand_as(log_ratio)
    if kind == "k1":  # ratio bounds, compared in log space as verl does
        return (stat >= math.log(lower)) & (stat <= math.log(upper))
    return stat <= upper


@torch.no_grad()
def rejection_keep_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, row_sum: RowSum, rollout_rs: str, threshold: Optional[Threshold]
) -> torch.Tensor:
    """``[B, T]`` float keep mask (1 = the token passes every option of ``rollout_rs``), verl's
    ``compute_rollout_rejection_mask`` times the loss mask."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    for option in options:
        keep &= _option_keep(option, log_ratio, mask, row_sum, bounds[option])
    return (keep & mask.bool()).to(log_ratio.dtype)
