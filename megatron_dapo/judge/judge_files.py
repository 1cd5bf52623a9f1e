"""What the ``reward.judge`` section asks of the judge's files (``config/plan.plan_problems`` runs it with the reward
files): its ``config.json`` readable, room for an input and an answer in its context, its attention heads split by
the rollout's TP, a tokenizer where the config says. vLLM would refuse the first three only once the job runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_dapo.config.schema import JudgeConfig

KEY = "reward.judge"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    return hf.get("text_config") or hf  # a multimodal checkpoint keeps its language model's sizes there


def judge_file_problems(cfg: JudgeConfig, rollout_tp: int) -> list[str]:
    """Problem lines naming the field; none while ``model_path`` is unset."""
    if not cfg.model_path:
        return []
    path = Path(cfg.model_path) / "config.json"
    try:
        hf = _text_config(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        return [f"{KEY}.model_path={cfg.model_path!r}: no readable config.json ({exc}); expected an HF model directory"]
    out = []
    positions = hf.get("max_position_embeddings")
    lengths = (cfg.max_prompt_length, cfg.max_tokens)
    needed = sum(lengths) if all(isinstance(x, int) for x in lengths) else None  # else the range rule names them
    if isinstance(positions, int) and needed is not None and needed > positions:
        out.append(
            f"{KEY}.max_prompt_length={cfg.max_prompt_length} + {KEY}.max_tokens={cfg.max_tokens} = {needed}: more than"
            f" the judge's max_position_embeddings={positions}; lower them"
        )
    tp = rollout_tp if isinstance(rollout_tp, int) and rollout_tp >= 1 else 1  # else the rollout rule names it
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if isinstance(heads, int) and heads % tp:
        out.append(
            f"{KEY}.model_path: the judge's num_attention_heads={heads} is not split by"
            f" rollout.tensor_model_parallel_size={tp}, the judge engine's TP (docs/judge.md)"
        )
    # vLLM splits the KV heads over TP, or replicates each over tp / kv ranks where there are fewer
    if isinstance(kv, int) and kv and (kv % tp if kv >= tp else tp % kv):
        out.append(
            f"{KEY}.model_path: the judge's num_key_value_heads={kv} is neither split by nor a divisor of"
            f" rollout.tensor_model_parallel_size={tp}, the judge engine's TP (docs/judge.md)"
        )
    tokenizer = Path(cfg.tokenizer_path or cfg.model_path)
    if not any((tokenizer / f).is_file() for f in TOKENIZER_FILES):
        key = f"{KEY}.tokenizer_path" if cfg.tokenizer_path else f"{KEY}.model_path"
        out.append(
            f"{key}={str(tokenizer)!r}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); set {KEY}.tokenizer_path"
        )
    return out
