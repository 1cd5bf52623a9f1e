"""``JudgeScorer``: the generative judge as one more reward term (docs/judge.md).

Every rollout rank calls ``score_judge`` with the same batch (collective): each response is decoded with the
actor's tokenizer, put into ``reward.judge.prompt_template`` with its prompt and ground truth
(``judge_prompt.fill``), tokenized with the judge's tokenizer (through its chat template with
``apply_chat_template``), and the whole batch goes to the judge's engine at once (``judge_engine.JudgeEngine``).
Each answer is parsed by the configured parser (``parsers.py``) and clamped into ``score_range``; an answer that
does not parse, or an input over ``max_prompt_length`` tokens (not sent), scores ``reward.error_score``.
``weight x score`` is added to the response's reward, as the reward model's term is (``rm/scorer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dapo.config.plan import RolloutPlan
from megatron_dapo.config.schema import JudgeConfig, RewardConfig
from megatron_dapo.data.tokens import decode_responses, load_tokenizer
from megatron_dapo.judge.judge_engine import JudgeEngine
from megatron_dapo.judge.judge_prompt import fill
from megatron_dapo.judge.parsers import Parser, build_parser, clamped
from megatron_dapo.platform import Platform
from megatron_dapo.reward.scoring import RewardResult
from megatron_dapo.rollout.types import RolloutBatch


@dataclass
class JudgeVerdicts:
    """A batch's judge outcome, per response: the answer text, the parsed score (None: no score) and whether the
    input was too long to send."""

    answers: list[str]
    parsed: list[Optional[float]]
    overlong: list[bool]

    def scores(self, error_score: float) -> torch.Tensor:
        """``[N]`` float32: the parsed score, ``error_score`` where there is none."""
        return torch.tensor([error_score if p is None else p for p in self.parsed], dtype=torch.float32)


class JudgeScorer:
    """The judge's tokenizer, parser and engine, with its config section and ``reward.error_score``."""

    def __init__(self, cfg: JudgeConfig, error_score: float, tokenizer: Any, engine: Any, actor_tokenizer: Any) -> None:
        self.cfg, self.error_score = cfg, float(error_score)
        self.tokenizer, self.engine, self.actor_tokenizer = tokenizer, engine, actor_tokenizer
        self.parser: Parser = build_parser(cfg.parser, cfg.pattern, cfg.choices)
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"reward.judge.apply_chat_template=true: the tokenizer of {cfg.model_path} has no chat template;"
                " set reward.judge.apply_chat_template=false to send the filled template as it is"
            )

    @classmethod
    def build(
        cls, reward: RewardConfig, plan: RolloutPlan, platform: Platform, actor_tokenizer: Any, timeout_s: float
    ) -> JudgeScorer:
        """The judge of ``reward.judge`` on this rollout rank (collective: every rank starts its engine member)."""
        cfg = reward.judge
        tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.model_path)
        eos = tokenizer.eos_token_id
        stops = [] if eos is None else [int(eos)]
        return cls(
            cfg, reward.error_score, tokenizer, JudgeEngine(cfg, plan, platform, stops, timeout_s), actor_tokenizer
        )

    def inputs(self, rollout: RolloutBatch, items: list[dict]) -> list[list[int]]:
        """The judge's input tokens for each response of ``rollout`` (rows of ``items`` by ``prompt_index``)."""
        texts = decode_responses(self.actor_tokenizer, rollout.responses, rollout.response_lengths.tolist())
        out = []
        for row, response in zip(rollout.prompt_index.tolist(), texts):
            text = fill(self.cfg.prompt_template, items[row], response)
            if self.cfg.apply_chat_template:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
            out.append(list(self.tokenizer.encode(text, add_special_tokens=not self.cfg.apply_chat_template)))
        return out

    def judge(self, inputs: list[list[int]]) -> JudgeVerdicts:
        """Send the inputs that fit ``max_prompt_length`` in one batch; parse and clamp every answer. Collective."""
        fits = [i for i, x in enumerate(inputs) if 0 < len(x) <= self.cfg.max_prompt_length]
        answers = [""] * len(inputs)
        for i, tokens in zip(fits, self.engine.generate([inputs[i] for i in fits])):
            answers[i] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        sent = set(fits)
        parsed = [clamped(self.parser(a), self.cfg.score_range) if i in sent else None for i, a in enumerate(answers)]
        return JudgeVerdicts(answers, parsed, [i not in sent for i in range(len(inputs))])

    def close(self) -> None:
        self.engine.close()


def judge_metrics(verdicts: JudgeVerdicts, scores: torch.Tensor) -> dict[str, float]:
    """``reward/judge_score/mean|max|min`` (the scores used, ``reward.error_score`` included),
    ``reward/judge_parse_failures`` (answers without a score) and ``reward/judge_overlong`` (inputs not sent)."""
    overlong = sum(verdicts.overlong)
    failures = sum(p is None for p in verdicts.parsed) - overlong
    out = {"reward/judge_parse_failures": float(failures), "reward/judge_overlong": float(overlong)}
    if scores.numel():
        out.update(
            {
                "reward/judge_score/mean": scores.mean().item(),
                "reward/judge_score/max": scores.max().item(),
                "reward/judge_score/min": scores.min().item(),
            }
        )
    return out


def add_judge_scores(result: RewardResult, verdicts: JudgeVerdicts, weight: float, error_score: float) -> None:
    """One more reward term: ``weight x`` each response's judge score added to its reward (``scores`` and the last
    response token of ``token_level_scores``), the scores and answers kept in ``extra``, the metrics added."""
    scores = verdicts.scores(error_score)
    if scores.shape != result.scores.shape:
        raise ValueError(f"judge scores: shape {tuple(scores.shape)}, the batch's rewards {tuple(result.scores.shape)}")
    term = weight * scores.to(result.scores.dtype)
    result.scores += term
    width = result.token_level_scores.shape[1]
    if width and len(term):
        lengths = result.response_lengths
        if lengths is None:
            raise ValueError("judge scores: the reward result carries no response_lengths")
        last = torch.where(lengths > 0, lengths - 1, torch.full_like(lengths, width - 1))
        result.token_level_scores[torch.arange(len(term)), last] += term
    result.extra["judge_score"] = scores.tolist()
    result.extra["judge_answer"] = list(verdicts.answers)
    result.metrics.update(judge_metrics(verdicts, scores))


def score_judge(judge: Optional[JudgeScorer], result: RewardResult, rollout: RolloutBatch, items: list[dict]) -> None:
    """The reward stage's hook: with a judge, judge ``rollout`` (collective over the rollout ranks) and add its term
    to ``result``; nothing without one."""
    if judge is None:
        return
    verdicts = judge.judge(judge.inputs(rollout, items))
    add_judge_scores(result, verdicts, judge.cfg.weight, judge.error_score)
