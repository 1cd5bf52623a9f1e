"""The judge's terms in ``config/memory.py``'s model, and its line in ``megatron-dapo check``.

Two terms per rollout rank: ``judge weights`` (the checkpoint's parameters, counted from its safetensors headers, in
``reward.judge.dtype``, / rollout TP; the replicated norms make it a slight undercount) and ``judge KV cache``
(``reward.judge.kv_cache_memory_mb`` on vLLM-CPU; on a device vLLM gives the engine ``gpu_memory_utilization`` x the
device, less its weights). Where vLLM sleeps, the judge is awake only while it scores, inside generation (``gen``),
and its weights wait in host memory otherwise (level 1); without a sleep mode both terms stay resident. The
start-up row has neither: the judge is built after the rollout engine."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import JudgeConfig
from megatron_dapo.weights.safetensors_io import SafetensorsIntegrityError, read_header

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
WEIGHTS, KV = "judge weights", "judge KV cache"


def judge_params(model_path: str) -> Optional[int]:
    """The judge checkpoint's parameter count from its safetensors headers; None where they are not readable here
    (``check`` away from the files: the terms are then left out)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for path in files:
            for info in read_header(path)[0].values():
                count = 1
                for d in info.shape:
                    count *= d
                total += count
    except (OSError, SafetensorsIntegrityError):
        return None
    return total


def judge_terms(cfg: JudgeConfig, plan: RunPlan, capacity: Optional[float]) -> dict[str, float]:
    """``{judge weights, judge KV cache}`` bytes on one rollout rank; empty without a judge (or its files)."""
    if not cfg.model_path:
        return {}
    params = judge_params(cfg.model_path)
    if params is None:
        return {}
    weights = params * DTYPE_BYTES.get(cfg.dtype, 4) / plan.rollout.tp_size
    kv = cfg.kv_cache_memory_mb * 2**20
    if plan.on_device and capacity is not None:
        kv = max(0.0, cfg.gpu_memory_utilization * capacity - weights)
    return {WEIGHTS: float(weights), KV: float(kv)}


def place_judge(name: str, terms: dict[str, float], sleeps: bool, dev: dict, host: dict) -> None:
    """Put the judge's terms of phase ``name`` on the device or the host (module docstring)."""
    if not terms.get(WEIGHTS) or name == "startup":
        return
    if not sleeps or name == "gen":
        dev[WEIGHTS], dev[KV] = terms[WEIGHTS], terms[KV]
    else:
        host[WEIGHTS] = terms[WEIGHTS]


def judge_lines(cfg: JudgeConfig, plan: RunPlan, terms: dict[str, float]) -> list[str]:
    """``check``'s lines for the judge (none without one)."""
    if not cfg.model_path:
        return []
    rp = plan.rollout
    size = (
        f"weights {terms[WEIGHTS] / 2**20:.2f} MiB + KV cache {terms[KV] / 2**20:.2f} MiB per rank"
        if terms.get(WEIGHTS)
        else "size unknown (its checkpoint is not readable here)"
    )
    when = "asleep except while it scores (level 1)" if rp.sleeps else "resident (no vLLM sleep mode here)"
    return [
        f"  judge: {cfg.model_path}: a second vLLM engine at rollout TP {rp.tp_size} in each of the {rp.dp_size}"
        f" replica(s); {size}; {when}",
        f"  judge: input <= {cfg.max_prompt_length} tokens, answer <= {cfg.max_tokens}; parser {cfg.parser};"
        f" reward += {cfg.weight:g} x score (reward.error_score where none)",
    ]
