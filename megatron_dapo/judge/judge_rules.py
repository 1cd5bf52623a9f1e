"""The ``reward.judge`` section's rules (``config/rules.py`` runs them with the others): its ranges, its template and
parser, and the modes the judge (``docs/judge.md``) runs in. Pure: no file is read."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from megatron_dapo.judge.judge_prompt import REQUIRED_FIELDS, TEMPLATE_FIELDS, template_fields
from megatron_dapo.judge.parsers import PARSERS

if TYPE_CHECKING:  # config/rules.py imports this module: the config package is still loading then
    from megatron_dapo.config.schema import JudgeConfig, RewardConfig, TrainerConfig

KEY = "reward.judge"
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # dtypes.CONFIG_NAMES, not imported here: dtypes loads torch


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def template_problems(template: Any) -> list[str]:
    """``prompt_template``: a string whose fields are among ``TEMPLATE_FIELDS`` and include ``{response}``."""
    key = f"{KEY}.prompt_template"
    if not isinstance(template, str):
        return [f"{key}={template!r}: expected a string"]
    try:
        names = template_fields(template)
    except ValueError as exc:
        fields = "{prompt}, {response}, {ground_truth}"
        return [f"{key}: malformed ({exc}); its fields are {fields}, literal braces are written doubled"]
    out = []
    unknown = sorted(set(names) - set(TEMPLATE_FIELDS))
    if unknown:
        out.append(f"{key}: unknown fields {unknown}; expected only {list(TEMPLATE_FIELDS)} (literal braces doubled)")
    missing = [f for f in REQUIRED_FIELDS if f not in names]
    if missing:
        out.append(f"{key}: no {{{missing[0]}}} field; the judge must read the response it scores")
    return out


def parser_problems(judge: JudgeConfig) -> list[str]:
    """``parser`` is a registered name, with what it needs (``pattern`` / ``choices``)."""
    if judge.parser not in PARSERS:
        return [f"{KEY}.parser={judge.parser!r}: expected one of {sorted(PARSERS)}"]
    if judge.parser == "regex":
        if not isinstance(judge.pattern, str) or not judge.pattern:
            return [f"{KEY}.pattern={judge.pattern!r}: parser=regex needs a regular expression"]
        try:
            re.compile(judge.pattern)
        except re.error as exc:
            return [f"{KEY}.pattern={judge.pattern!r}: not a regular expression ({exc})"]
    if judge.parser == "choice":
        ok = bool(judge.choices) and all(isinstance(k, str) and k and _finite(v) for k, v in judge.choices.items())
        if not ok:
            return [f"{KEY}.choices={judge.choices!r}: parser=choice needs labels mapped to finite scores"]
    return []


def _range_problems(judge: JudgeConfig) -> list[str]:
    out = []
    if not _finite(judge.weight):
        out.append(f"{KEY}.weight={judge.weight!r}: expected a finite number")
    if not (_finite(judge.temperature) and judge.temperature >= 0):
        out.append(f"{KEY}.temperature={judge.temperature!r}: expected a finite number >= 0")
    if not (_finite(judge.top_p) and 0 < judge.top_p <= 1):
        out.append(f"{KEY}.top_p={judge.top_p!r}: expected a number in (0, 1]")
    for name in ("max_tokens", "max_prompt_length", "max_num_seqs", "kv_cache_memory_mb"):
        if not _int_at_least(getattr(judge, name), 1):
            out.append(f"{KEY}.{name}={getattr(judge, name)!r}: expected an integer >= 1")
    if not _int_at_least(judge.seed, 0):
        out.append(f"{KEY}.seed={judge.seed!r}: expected an integer >= 0")
    if not (_finite(judge.gpu_memory_utilization) and 0 < judge.gpu_memory_utilization < 1):
        out.append(f"{KEY}.gpu_memory_utilization={judge.gpu_memory_utilization!r}: expected a number in (0, 1)")
    if judge.dtype not in DTYPE_NAMES:
        out.append(f"{KEY}.dtype={judge.dtype!r}: expected one of {list(DTYPE_NAMES)}")
    bounds = judge.score_range
    if bounds is not None and not (len(bounds) == 2 and all(map(_finite, bounds)) and bounds[0] <= bounds[1]):
        out.append(f"{KEY}.score_range={bounds!r}: expected [low, high], finite, low <= high (or unset)")
    return out


def judge_problems(rw: RewardConfig, trainer: TrainerConfig) -> list[str]:
    """Problem lines naming the field, its value and what is valid; none while ``model_path`` is unset."""
    judge = rw.judge
    if not judge.model_path:
        return []
    out = _range_problems(judge) + template_problems(judge.prompt_template) + parser_problems(judge)
    if trainer.mode != "sync":
        out.append(
            f"trainer.mode={trainer.mode!r} with {KEY}.model_path={judge.model_path!r}: the judge's engine is built"
            " beside the colocated rollout engine of a synchronous run only (the async rollout ranks build none);"
            f" set trainer.mode=sync or unset {KEY}.model_path"
        )
    return out
