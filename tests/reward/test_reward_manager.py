"""Reward manager: decoding, routing, placement, overlong shaping, worker pool errors and timeouts."""

from __future__ import annotations

import logging
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import (
    ConfigError,
    CustomFunctionConfig,
    DataConfig,
    ExperimentConfig,
    OverlongBufferConfig,
    RewardConfig,
    config_problems,
    raise_if_any,
)
from megatron_dapo.reward.manager import RewardManager, merge_results, route_data_source
from megatron_dapo.reward.scoring import outcome_row, route, scorer_label
from megatron_dapo.reward.workers import FailureLog

EOS_ID = 1


class CharTokenizer:
    """Test stand-in for an HF tokenizer: one token per character (id = code point); id 1 is EOS and, like some
    added tokens, is decoded as text even with skip_special_tokens; id 0 is padding."""

    eos_token = "</s>"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("</s>" if i == EOS_ID else chr(i) for i in ids if i != 0)


def encode(texts: list[str], width: int, eos: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        row = [ord(c) for c in text] + ([EOS_ID] if eos and eos[i] else [])
        row = row[:width]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def inline_manager(max_len: int = 32, **kwargs) -> RewardManager:
    return RewardManager(CharTokenizer(), RewardConfig(num_workers=0, **kwargs), max_response_length=max_len)


# ----------------------------------------------------------------------------- in-process logic


def test_routing() -> None:
    assert route_data_source("math_dapo") == "math_dapo"
    assert route_data_source("math") == "math_dapo"
    assert route_data_source("aime2024") == "math_dapo"
    assert route_data_source("gsm8k") == "custom"


def test_scores_placed_on_last_valid_token_and_eos_text_stripped() -> None:
    rm = inline_manager()
    texts = ["Answer: 5", "Answer: 7", "Answer: 12", ""]
    ids, mask = encode(texts, 16, eos=[True, False, False, False])
    res = rm(ids, mask, ["math_dapo", "aime24", "math", "math"], ["5", "8", "12", "1"], [{}, {}, None, {}])
    assert res.scores.tolist() == [1.0, -1.0, 1.0, -1.0]  # "Answer: 5</s>" is scored as "Answer: 5"
    assert res.response_lengths.tolist() == [10, 9, 10, 0]
    expected = torch.zeros(4, 16)
    expected[0, 9], expected[1, 8], expected[2, 9], expected[3, 15] = 1.0, -1.0, 1.0, -1.0  # empty row: T - 1
    assert torch.equal(res.token_level_scores, expected)
    assert res.token_level_scores.dtype == torch.float32
    assert res.extra["acc"] == [True, False, True, False]
    assert res.extra["pred"] == ["5", "7", "12", "[INVALID]"]
    assert res.extra["score"] == [1.0, -1.0, 1.0, -1.0]
    assert res.extra["overlong_reward"] == [0.0] * 4 and res.extra["overlong"] == [False] * 4
    assert res.metrics["reward/num_errors"] == 0.0 and res.metrics["reward/num_timeouts"] == 0.0


def test_shards_scored_apart_merge_into_the_whole_batch_result() -> None:
    """What the trainer does with several ranks: rank r scores rows r, r + w, ...; the merge equals one call."""
    rm = inline_manager()
    texts = ["Answer: 5", "Answer: 7", "Answer: 12", "", "Answer: 3", "x"]
    ids, mask = encode(texts, 16)
    sources, truths = ["math"] * 6, ["5", "8", "12", "1", "3", "2"]
    whole = rm(ids, mask, sources, truths)
    parts = []
    for r in range(4):  # 4 "ranks", uneven shards
        rows = list(range(r, 6, 4))
        parts.append((rows, rm(ids[rows], mask[rows], [sources[i] for i in rows], [truths[i] for i in rows])))
    merged = merge_results(parts, 6)
    assert torch.equal(merged.token_level_scores, whole.token_level_scores)
    assert torch.equal(merged.scores, whole.scores) and torch.equal(merged.overlong, whole.overlong)
    assert torch.equal(merged.response_lengths, whole.response_lengths)
    assert merged.extra == whole.extra
    assert merged.metrics == pytest.approx(whole.metrics)
    with pytest.raises(ValueError, match="cover 2 rows, the batch has 6"):
        merge_results(parts[:1], 6)


def test_unknown_data_source_without_custom_function() -> None:
    rm = inline_manager()
    ids, mask = encode(["x"], 4)
    with pytest.raises(ConfigError, match="'gsm8k'.*reward.custom_function.path"):
        rm(ids, mask, ["gsm8k"], ["1"], [{}])


def test_overlong_shaping_and_truncation_flag() -> None:
    cfg = RewardConfig(num_workers=0, overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0))
    texts = ["Answer: 1", "Answer: 12", "Answer: 1 ", "Answer: 1"]  # lengths 9, 10, 10, 9 (+EOS = 10)
    ids, mask = encode(texts, 12, eos=[False, False, False, True])
    sources, truths = ["math"] * 4, ["1", "12", "1", "1"]
    res = RewardManager(CharTokenizer(), cfg, max_response_length=10)(ids, mask, sources, truths)
    # free up to 6 tokens; penalty -(L - 6) / 4
    assert res.extra["overlong_reward"] == [-0.75, -1.0, -1.0, -1.0]
    assert res.scores.tolist() == [0.25, 0.0, 0.0, 0.0]
    assert res.extra["score"] == [1.0, 1.0, 1.0, 1.0]
    assert res.extra["overlong"] == [False, True, True, True]  # hit max length
    with_eos = RewardManager(CharTokenizer(), cfg, max_response_length=10, eos_token_id=EOS_ID)
    res = with_eos(ids, mask, sources, truths)
    assert res.extra["overlong"] == [False, True, True, False]  # ended with EOS exactly at the limit
    assert res.overlong.tolist() == [False, True, True, False]
    assert res.metrics["reward/num_overlong"] == 2.0


def test_empty_batch() -> None:
    res = inline_manager()(torch.zeros(0, 8, dtype=torch.long), torch.zeros(0, 8), [], [], [])
    assert res.scores.shape == (0,) and res.token_level_scores.shape == (0, 8)
    assert res.metrics["reward/num_errors"] == 0.0


def test_input_and_config_errors(tmp_path: Path) -> None:
    rm = inline_manager()
    ids, mask = encode(["a", "b"], 4)
    with pytest.raises(ValueError, match="ground_truths has 1 entries"):
        rm(ids, mask, ["math", "math"], ["1"], [{}, {}])
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        rm(ids, mask[:, :2], ["math", "math"], ["1", "2"])
    # The reward section's rules run in the command's gate (config/rules.py), not in the manager.
    with pytest.raises(ConfigError, match=r"reward.extra_functions\[0\]: unknown keys \['wieght'\]"):
        raise_if_any(config_problems(with_reward(RewardConfig(extra_functions=[{"path": "x.py", "wieght": 1}]), 8)))
    with pytest.raises(ConfigError, match="overlong_buffer.len=16"):
        raise_if_any(
            config_problems(with_reward(RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=16)), 8))
        )
    missing = CustomFunctionConfig(path=str(tmp_path / "nope.py"))
    with pytest.raises(FileNotFoundError, match="nope.py"):
        RewardManager(CharTokenizer(), RewardConfig(custom_function=missing), 8)


def with_reward(reward: RewardConfig, max_response_length: int) -> ExperimentConfig:
    return ExperimentConfig(reward=reward, data=DataConfig(max_response_length=max_response_length))


def test_config_problems_are_raised_once_from_the_config_rules() -> None:
    """A ``reward`` section is checked by the config rules (the command's gate; the manager checks nothing again):
    every problem in one ``ConfigError``, before any file is imported (the extra function's file does not exist)."""
    cfg = RewardConfig(
        error_score=float("nan"),
        extra_functions=[{"path": "missing.py", "weight": float("inf")}, {"path": "missing.py", "weight": True}],
        overlong_buffer=OverlongBufferConfig(enable=True, len=16),
    )
    with pytest.raises(ConfigError) as err:
        raise_if_any(config_problems(with_reward(cfg, 8)))
    assert err.value.problems[:3] == [
        "reward.error_score=nan: expected a finite number",
        "reward.extra_functions[0].weight=inf: expected a finite number",
        "reward.extra_functions[1].weight=True: expected a finite number",
    ]
    # a training run's buffer is the tail of the response budget: strictly shorter than it
    overlong = "reward.overlong_buffer.len=16 must be shorter than data.max_response_length=8"
    assert err.value.problems[3].startswith(overlong)
    assert len(err.value.problems) == 4
    fits = with_reward(RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=7)), 8)
    assert raise_if_any(config_problems(fits)) is None


def test_scoring_rules_are_pure_functions() -> None:
    assert route(["math", "aime25"], has_custom_function=False) == ["math_dapo", "math_dapo"]
    assert route(["toy"], has_custom_function=True) == ["custom"]
    with pytest.raises(ConfigError, match="'toy'"):
        route(["math", "toy"], has_custom_function=False)
    ok = ("ok", ({"score": 0.5, "acc": None, "pred": "x"}, None))
    assert outcome_row(ok, 0, -1.0) == {"score": 0.5, "acc": None, "pred": "x"}
    assert outcome_row(("timeout", "too slow"), 1, -1.0) == {"score": -1.0, "acc": False}
    assert outcome_row(("error", "boom"), 2, 2) == {"score": 2.0, "acc": False}
    assert scorer_label("math_dapo", None) == "math_dapo" and scorer_label("custom", None) == "custom"


def test_failure_log_counts_and_limits(caplog) -> None:
    log = FailureLog(max_logged_errors=1, error_score=-1.0)
    outcomes = [("ok", ({"score": 1.0, "acc": None}, "acc dropped")), ("error", "boom"), ("timeout", "slow")]
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.reward.manager"):
        assert log.report(outcomes, ["a", "b", "c"], ["f", "f", "f"]) == (1, 1)
        assert log.report(outcomes[:1], ["a"], ["f"]) == (0, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("acc dropped" in m for m in messages) == 1  # once per manager
    assert any("reward error for response 1 (data_source='b', function f)" in m and "boom" in m for m in messages)
    assert any("1 more failures not logged (reward.max_logged_errors=1)" in m for m in messages)


def test_inline_custom_function_errors_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "inline_reward.py"
    path.write_text("def f(data_source, solution_str, ground_truth, extra_info):\n    return 1 / int(solution_str)\n")
    rm = RewardManager(
        CharTokenizer(),
        RewardConfig(num_workers=0, error_score=-3.0, custom_function=CustomFunctionConfig(path=str(path), name="f")),
        16,
    )
    ids, mask = encode(["4", "0"], 4)
    res = rm(ids, mask, ["toy", "toy"], [None, None], None)
    assert res.scores.tolist() == [0.25, -3.0]
    assert res.extra["acc"] == [None, False]  # a score other than 0/1 says nothing about accuracy; errors are False
    assert res.metrics["reward/num_errors"] == 1.0


# ----------------------------------------------------------------------------- worker pool

SCORERS = textwrap.dedent(
    """
    import os
    import signal
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str.startswith("raise"):
            raise ValueError("scorer exploded on purpose")
        if solution_str.startswith("sleep"):
            time.sleep(30)
        if solution_str.startswith("hang"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # ignore the soft timeout
            time.sleep(30)
        if solution_str.startswith("die"):
            os._exit(7)
        if solution_str.startswith("nap"):
            time.sleep(0.2)
        return {"score": float(solution_str == ground_truth), "source": data_source, "pid": os.getpid()}
    """
)


@pytest.fixture(scope="module")
def pool_manager(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("scorers") / "scorers.py"
    path.write_text(SCORERS)
    cfg = RewardConfig(
        custom_function=CustomFunctionConfig(path=str(path)),
        num_workers=2,
        timeout_s=0.5,
        error_score=-0.5,
        max_logged_errors=1,
    )
    with RewardManager(CharTokenizer(), cfg, max_response_length=16, hard_timeout_grace_s=0.5) as rm:
        yield rm


def test_pool_scores_errors_and_soft_timeouts(pool_manager: RewardManager, caplog) -> None:
    texts = ["ok", "raise", "Answer: 3", "sleep", "ok"]
    ids, mask = encode(texts, 16)
    sources = ["toy", "toy", "math_dapo", "toy", "toy"]
    truths = ["ok", "", "3", "", "no"]
    executor = pool_manager.pool.ensure_started()
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.reward.manager"):
        start = time.monotonic()
        res = pool_manager(ids, mask, sources, truths, [{}] * 5)
        elapsed = time.monotonic() - start
    assert elapsed < 10  # the 30 s sleeper was interrupted...
    assert pool_manager.pool.executor is executor  # ...inside its worker (soft timeout): the pool was not restarted
    assert res.scores.tolist() == [1.0, -0.5, 1.0, -0.5, 0.0]
    assert res.metrics["reward/num_errors"] == 1.0
    assert res.metrics["reward/num_timeouts"] == 1.0
    assert res.extra["source"] == ["toy", None, None, None, "toy"]
    assert res.extra["pred"] == [None, None, "3", None, None]
    messages = [r.getMessage() for r in caplog.records]
    assert any("scorer exploded on purpose" in m for m in messages)  # first failure logged with its traceback
    assert any("1 more failures not logged" in m for m in messages)  # max_logged_errors=1


def test_pool_hard_timeout_restarts_workers(pool_manager: RewardManager) -> None:
    executor = pool_manager.pool.ensure_started()
    ids, mask = encode(["hang", "ok", "ok"], 16)
    res = pool_manager(ids, mask, ["toy"] * 3, ["", "ok", "ok"], None)
    assert res.scores.tolist() == [-0.5, 1.0, 1.0]
    assert res.metrics["reward/num_timeouts"] == 1.0
    assert pool_manager.pool.executor is not executor  # the stuck worker's pool was killed
    ids, mask = encode(["ok"], 16)  # the recreated pool works
    assert pool_manager(ids, mask, ["toy"], ["ok"], None).scores.tolist() == [1.0]


def test_pool_worker_death_only_fails_the_culprit(pool_manager: RewardManager) -> None:
    texts = ["ok", "die", "ok", "ok"]
    ids, mask = encode(texts, 16)
    res = pool_manager(ids, mask, ["toy"] * 4, ["ok"] * 4, None)
    assert res.scores.tolist() == [1.0, -0.5, 1.0, 1.0]
    assert res.metrics["reward/num_errors"] == 1.0 and res.metrics["reward/num_timeouts"] == 0.0


def work_until(stream, settled: int, seconds: float) -> float:
    """The caller's other work (the engine generating), until ``settled`` outcomes are in; its duration."""
    start = time.monotonic()
    while stream.settled() < settled and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def test_stream_scores_while_the_caller_works(pool_manager: RewardManager) -> None:
    """``reward.overlap_generation``'s pool side: responses added one by one are scored by the workers while the
    caller does something else, before ``finish``; the rows equal the whole batch's, scored by ``__call__``."""
    texts = ["nap", "nap b", "nap", "Answer: 3", "nap"]
    sources, truths = ["toy", "toy", "toy", "math_dapo", "toy"], ["nap", "x", "nap", "3", "nap"]
    ids, mask = encode(texts, 16)
    pool_manager.pool.ensure_started()
    stream = pool_manager.stream()
    for i, text in enumerate(texts):
        stream.add([ord(c) for c in text], sources[i], truths[i], None)
    assert stream.settled() < len(texts)  # five 0.2 s calls on two workers are not done yet
    work_until(stream, len(texts), seconds=5)
    assert stream.settled() == len(texts)  # all scored before finish
    rows, failures = stream.finish()
    overlapped = pool_manager.result(rows, ids, mask, failures)
    whole = pool_manager(ids, mask, sources, truths, None)
    assert overlapped.scores.tolist() == whole.scores.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert overlapped.metrics == whole.metrics
    for key in ("score", "acc", "source", "pred", "overlong_reward", "overlong"):  # not "pid": which worker scored
        assert overlapped.extra[key] == whole.extra[key], key


def test_stream_enforces_the_hard_deadline_while_the_caller_works(pool_manager: RewardManager) -> None:
    """A scorer stuck past the hard deadline is settled as a timeout (and its pool replaced) while the caller does
    something else, not only when the batch is collected."""
    stream = pool_manager.stream()
    stream.add([ord(c) for c in "hang"], "toy", "", None)
    stream.add([ord(c) for c in "ok"], "toy", "ok", None)
    waited = work_until(stream, 2, seconds=5)
    assert stream.settled() == 2 and waited < 4  # timeout 0.5 s + grace 0.5 s
    rows, failures = stream.finish()
    assert [r["score"] for r in rows] == [-0.5, 1.0] and failures == (0, 1)


def test_calls_per_task_grow_with_the_backlog() -> None:
    from megatron_dapo.reward.workers import MAX_CALLS_PER_TASK, chunk_size

    assert [chunk_size(w, 2) for w in (0, 1, 3, 4, 8, 9, 40)] == [1, 1, 1, 1, 2, 2, 10]
    assert chunk_size(10_000, 2) == MAX_CALLS_PER_TASK


@pytest.mark.parametrize("culprit", ["hang", "die"])
def test_a_task_of_many_calls_fails_only_its_culprit(pool_manager: RewardManager, culprit: str) -> None:
    """40 calls on 2 workers go in tasks of 10; a call that hangs past the hard deadline or kills its worker inside
    one is found by re-running that task's calls one at a time: only it fails, every other call is scored."""
    texts = ["ok"] * 40
    texts[15] = culprit
    ids, mask = encode(texts, 16)
    res = pool_manager(ids, mask, ["toy"] * 40, ["ok"] * 40, None)
    expected = [1.0] * 40
    expected[15] = -0.5
    assert res.scores.tolist() == expected
    failures = (res.metrics["reward/num_errors"], res.metrics["reward/num_timeouts"])
    assert failures == ((0.0, 1.0) if culprit == "hang" else (1.0, 0.0))
