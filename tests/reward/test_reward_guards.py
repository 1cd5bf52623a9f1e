"""Rewards are finite numbers or errors, and no reward setting can hang.

A scorer result that is not a finite number (NaN, inf, None, bool, str, list, dict without a usable score,
non-finite numpy/torch scalars) scores ``reward.error_score``, is counted in ``reward/num_errors`` and is logged with
its value, data source and function, in-process and in the worker pool, for one function and for a weighted
combination. ``reward.timeout_s`` holds in-process (SIGALRM) as in the pool, and the caller's SIGALRM handler, mask
and timer survive the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dapo.config import (
    ConfigError,
    CustomFunctionConfig,
    OverlongBufferConfig,
    RewardConfig,
    config_problems,
    load_config,
    raise_if_any,
)
from megatron_dapo.reward import custom
from megatron_dapo.reward.custom import InvalidRewardError, combine, load_reward_function, normalise_result
from megatron_dapo.reward.manager import RewardInvariantError, RewardManager
from megatron_dapo.reward.scoring import check_row
from tests.reward.test_reward_manager import CharTokenizer, encode

LOGGER = "megatron_dapo.reward.manager"
ERROR_SCORE = -2.0

# ----------------------------------------------------------------------------- result checks (unit)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (NAN, "returned a non-finite number: nan;"),
        (INF, "returned a non-finite number: inf;"),
        (-INF, "returned a non-finite number: -inf;"),
        (None, "returned None: None;"),
        (True, "returned a bool, not a number: True;"),
        ("1.0", "returned a str, not a number: '1.0';"),
        ([1.0], "returned a list, not a number: [1.0];"),
        (1j, "returned a complex, not a number: 1j;"),
        (10**400, "returned a number that does not fit in a float: 1000"),
        ({"acc": True}, "returned a dict without a 'score' key: {'acc': True};"),
        ({"score": NAN, "acc": True}, "returned a dict whose 'score' is a non-finite number: nan (in {"),
        ({"score": -INF}, "'score' is a non-finite number: -inf"),
        ({"score": False}, "'score' is a bool, not a number: False"),
        ({"score": None}, "'score' is None: None"),
        ({"score": "0.5"}, "'score' is a str, not a number: '0.5'"),
        (np.float64("nan"), "returned a non-finite number: np.float64(nan);"),
        (np.float32("-inf"), "returned a non-finite number: np.float32(-inf);"),
        (np.bool_(True), "returned a bool, not a number: np.True_;"),
        (np.array([1.0]), "returned a ndarray, not a number: array([1.])"),
        (torch.tensor(NAN), "returned a non-finite number: tensor(nan);"),
        (torch.tensor(-INF), "returned a non-finite number: tensor(-inf);"),
        (torch.tensor(True), "returned a bool, not a number: tensor(True);"),
        (torch.tensor([0.5]), "returned a Tensor, not a number: tensor([0.5000])"),
    ],
)
def test_invalid_results_name_function_and_value(result, message: str) -> None:
    with pytest.raises(InvalidRewardError) as info:
        normalise_result(result, "/data/r.py:f")
    text = str(info.value)
    assert text.startswith("reward function /data/r.py:f returned ")
    assert message in text
    assert text.endswith("expected a finite int or float (or a dict whose 'score' is one)")


def test_long_values_are_truncated_in_messages() -> None:
    with pytest.raises(InvalidRewardError) as info:
        normalise_result("x" * 100_000, "f")
    assert len(str(info.value)) < 400 and "xxx" in str(info.value)


@pytest.mark.parametrize(
    ("result", "score"),
    [
        (1, 1.0),
        (-0.25, -0.25),
        (Fraction(1, 4), 0.25),
        (np.float32(0.25), 0.25),
        (np.int64(3), 3.0),
        (np.array(0.75), 0.75),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(2), 2.0),
        (torch.tensor(-1.5, dtype=torch.bfloat16), -1.5),
        ({"score": np.float64(-1.0), "pred": "7"}, -1.0),
        ({"score": torch.tensor(0.125)}, 0.125),
    ],
)
def test_finite_numbers_are_accepted_as_python_floats(result, score: float) -> None:
    row, note = normalise_result(result, "f")
    assert type(row["score"]) is float and row["score"] == score and note is None


@pytest.mark.parametrize(
    ("acc", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (1.0, True),
        (np.bool_(False), False),
        (np.int64(1), True),
        (torch.tensor(True), True),
        (torch.tensor(0), False),
    ],
)
def test_acc_bool_or_zero_one(acc, expected: bool) -> None:
    row, note = normalise_result({"score": 0.5, "acc": acc, "pred": "x"}, "f")
    assert row == {"score": 0.5, "acc": expected, "pred": "x"} and type(row["acc"]) is bool and note is None


@pytest.mark.parametrize("acc", [0.5, 2, -1, NAN, "yes", [True], torch.tensor(0.5)])
def test_other_acc_is_missing_with_a_note(acc) -> None:
    row, note = normalise_result({"score": 1.0, "acc": acc}, "/data/r.py:f")
    assert row["acc"] is None and row["score"] == 1.0
    assert note is not None and "/data/r.py:f returned acc=" in note and "bool or 0/1" in note


@pytest.mark.parametrize(
    ("result", "row"),
    [
        (1.0, {"score": 1.0, "acc": True}),
        (0, {"score": 0.0, "acc": False}),
        (0.25, {"score": 0.25, "acc": None}),
        (-1.0, {"score": -1.0, "acc": None}),
        ({"score": 1}, {"score": 1.0, "acc": True}),
        ({"score": 0.5, "acc": None}, {"score": 0.5, "acc": None}),  # an explicit None is no problem: no note
    ],
)
def test_acc_without_acc_comes_from_a_zero_one_score(result, row: dict) -> None:
    assert normalise_result(result, "f") == (row, None)


# ----------------------------------------------------------------------------- combinations (unit)

FUNCTIONS = textwrap.dedent(
    """
    def good(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5, "acc": True}

    def nan_score(data_source, solution_str, ground_truth, extra_info):
        return float("nan")

    def bool_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": True}

    def huge(data_source, solution_str, ground_truth, extra_info):
        return 1e308
    """
)


def test_combination_paths_reject_non_finite_scores(tmp_path: Path) -> None:
    path = tmp_path / "functions.py"
    path.write_text(FUNCTIONS)
    good, nan_score, bool_score, huge = (
        load_reward_function(str(path), name) for name in ("good", "nan_score", "bool_score", "huge")
    )
    kwargs = {"data_source": "src", "solution_str": "", "ground_truth": "", "extra_info": None}
    label = re.escape(f"{path}:")
    # one function
    with pytest.raises(InvalidRewardError, match=f"{label}nan_score returned a non-finite number: nan"):
        combine([(nan_score, 1.0)])(**kwargs)
    with pytest.raises(InvalidRewardError, match=f"{label}bool_score returned a dict whose 'score' is a bool"):
        combine([(bool_score, 2.0)])(**kwargs)
    with pytest.raises(InvalidRewardError, match=f"{label}huge: its score times reward weight 10 is not finite"):
        combine([(huge, 10.0)])(**kwargs)
    # several: the message names the function at fault, not the first one
    pair = combine([(good, 1.0), (nan_score, 0.5)])
    assert pair.describe() == f"1 * {path}:good + 0.5 * {path}:nan_score"
    with pytest.raises(InvalidRewardError, match=f"{label}nan_score returned a non-finite number"):
        pair(**kwargs)
    with pytest.raises(InvalidRewardError, match=f"{label}bool_score returned a dict whose 'score' is a bool"):
        combine([(good, 1.0), (bool_score, 1.0)])(**kwargs)
    with pytest.raises(InvalidRewardError, match=r"the weighted sum 1 \* .*huge \+ 1 \* .*huge is not finite \(inf\)"):
        combine([(huge, 1.0), (huge, 1.0)])(**kwargs)
    assert combine([(good, 1.0), (huge, 1e-308)])(**kwargs) == {
        "score": 1.5,
        "score_0": 0.5,
        "score_1": 1e308,
        "acc": True,
    }
    with pytest.raises(ValueError, match=f"the weight of reward function {label}good must be finite, got inf"):
        combine([(good, INF)])


# ----------------------------------------------------------------------------- through the manager

BAD_SCORERS = textwrap.dedent(
    """
    import math

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        kind = solution_str
        if kind == "nan":
            return float("nan")
        if kind == "inf":
            return math.inf
        if kind == "-inf":
            return -math.inf
        if kind == "none":
            return None
        if kind == "bool":
            return True
        if kind == "str":
            return "1.0"
        if kind == "list":
            return [1.0]
        if kind == "noscore":
            return {"acc": True}
        if kind == "dnan":
            return {"score": float("nan"), "acc": True}
        if kind == "dbool":
            return {"score": False}
        if kind == "npnan":
            import numpy
            return numpy.float64("nan")
        if kind == "np":
            import numpy
            return numpy.float32(0.25)
        if kind == "torchinf":
            import torch
            return torch.tensor(float("inf"))
        if kind == "torch":
            import torch
            return torch.tensor(0.75)
        if kind == "int":
            return 1
        if kind == "badacc":
            return {"score": 0.5, "acc": 0.5}
        raise AssertionError(kind)

    def plus_half(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5, "tag": "half"}
    """
)

# solution text -> the log fragment showing the value
BAD = {
    "nan": "returned a non-finite number: nan;",
    "inf": "returned a non-finite number: inf;",
    "-inf": "returned a non-finite number: -inf;",
    "none": "returned None: None;",
    "bool": "returned a bool, not a number: True;",
    "str": "returned a str, not a number: '1.0';",
    "list": "returned a list, not a number: [1.0];",
    "noscore": "returned a dict without a 'score' key: {'acc': True};",
    "dnan": "returned a dict whose 'score' is a non-finite number: nan (in {'acc': True, 'score': nan})",
    "dbool": "returned a dict whose 'score' is a bool, not a number: False",
    "npnan": "returned a non-finite number: np.float64(nan);",
}
GOOD = {"np": 0.25, "int": 1.0, "badacc": 0.5}


@pytest.fixture(scope="module")
def bad_scorer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "bad_scorers.py"
    path.write_text(BAD_SCORERS)
    return path


def bad_config(path: Path, num_workers: int, combined: bool) -> RewardConfig:
    return RewardConfig(
        custom_function=CustomFunctionConfig(path=str(path)),
        extra_functions=[{"path": str(path), "name": "plus_half", "weight": 2.0}] if combined else [],
        num_workers=num_workers,
        error_score=ERROR_SCORE,
        max_logged_errors=len(BAD) + 5,
        timeout_s=30.0,
    )


@pytest.mark.parametrize(("num_workers", "combined"), [(0, False), (0, True), (1, False), (1, True)])
def test_non_finite_and_non_numeric_results_score_error_score(
    bad_scorer_file: Path, num_workers: int, combined: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # torch is imported only by in-process cases: a pool worker importing it would slow the test down
    good = {**GOOD, "torch": 0.75} if num_workers == 0 else GOOD
    bad = {**BAD, "torchinf": "returned a non-finite number: tensor(inf);"} if num_workers == 0 else BAD
    texts = [*bad, *good, "Answer: 3"]
    sources = [f"src_{t}" for t in [*bad, *good]] + ["math"]
    ids, mask = encode(texts, 16)
    with (
        RewardManager(CharTokenizer(), bad_config(bad_scorer_file, num_workers, combined), 16) as manager,
        caplog.at_level(logging.WARNING, logger=LOGGER),
    ):
        res = manager(ids, mask, sources, [""] * len(bad) + [""] * len(good) + ["3"], None)

    bonus = 1.0 if combined else 0.0  # plus_half, weight 2
    expected = [ERROR_SCORE] * len(bad) + [v + bonus for v in good.values()] + [1.0]
    assert res.scores.tolist() == expected
    assert bool(torch.isfinite(res.scores).all()) and bool(torch.isfinite(res.token_level_scores).all())
    assert res.token_level_scores.sum(dim=1).tolist() == expected
    assert res.metrics["reward/num_errors"] == float(len(bad)) and res.metrics["reward/num_timeouts"] == 0.0
    # acc: False for errors; 0.25 / 0.75 / 0.5 say nothing about accuracy; badacc's 0.5 is dropped; int 1 -> True
    accs = dict(zip(texts, res.extra["acc"], strict=True))
    assert [accs[t] for t in bad] == [False] * len(bad)
    assert accs["np"] is None and accs["badacc"] is None and accs["Answer: 3"] is True
    if combined:  # int: 1 + 2 * 0.5 = 2.0 is no accuracy either; other keys of the extra function are kept
        assert accs["int"] is None and res.extra["tag"][len(bad)] == "half"
    else:
        assert accs["int"] is True

    function = f"{bad_scorer_file}:compute_score"
    messages = [r.getMessage() for r in caplog.records]
    for kind, fragment in bad.items():
        logged = [m for m in messages if f"(data_source='src_{kind}'," in m]
        assert len(logged) == 1, (kind, messages)
        assert fragment in logged[0] and f"reward function {function} returned" in logged[0]
    acc_notes = [m for m in messages if "returned acc=0.5; acc must be a bool or 0/1" in m]
    assert len(acc_notes) == 1 and "data_source='src_badacc'" in acc_notes[0]


def test_max_logged_errors_still_limits_the_log(bad_scorer_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = bad_config(bad_scorer_file, 0, False)
    cfg.max_logged_errors = 2
    ids, mask = encode(list(BAD), 16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        res = RewardManager(CharTokenizer(), cfg, 16)(ids, mask, ["toy"] * len(BAD), [""] * len(BAD))
    assert res.metrics["reward/num_errors"] == float(len(BAD))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reward error for response" in m for m in messages) == 2
    assert any(f"{len(BAD) - 2} more failures not logged (reward.max_logged_errors=2)" in m for m in messages)


def test_internal_invariant_guard() -> None:
    check_row({"score": 0.5, "acc": None}, 0)
    for row in ({"score": NAN}, {"score": 1}, {"score": INF}, [0.5]):
        with pytest.raises(RewardInvariantError, match="internal error .* response 3"):
            check_row(row, 3)


def test_settings_that_could_let_nan_out_or_hang_are_rejected() -> None:
    for cfg, key in [
        (RewardConfig(error_score=NAN), "reward.error_score=nan"),
        (RewardConfig(timeout_s=0.0), "reward.timeout_s=0.0"),
        (RewardConfig(timeout_s=INF), "reward.timeout_s=inf"),
        (RewardConfig(num_workers=-1), "reward.num_workers=-1"),
        (RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=INF)), "penalty_factor"),
    ]:
        run = dataclasses.replace(load_config(None, ["data.max_response_length=8"]), reward=cfg)
        with pytest.raises(ConfigError, match=key):  # at the gate: the manager itself checks nothing again
            raise_if_any(config_problems(run))


# ----------------------------------------------------------------------------- timeouts

SLOW_SCORERS = textwrap.dedent(
    """
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "forever":
            while True:
                time.sleep(10**6)
        if solution_str == "swallow_exception":  # a timeout is no Exception
            while True:
                try:
                    time.sleep(10**6)
                except Exception:
                    pass
        if solution_str == "swallow_once":  # the alarm repeats until the scorer has unwound
            try:
                time.sleep(10**6)
            except BaseException:
                pass
            while True:
                time.sleep(10**6)
        if solution_str == "slow_ok":
            time.sleep(0.5)
        return 1.0
    """
)


@pytest.fixture(scope="module")
def slow_scorer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("slow") / "slow_scorers.py"
    path.write_text(SLOW_SCORERS)
    return path


def slow_manager(path: Path, num_workers: int, timeout_s: float) -> RewardManager:
    cfg = RewardConfig(
        custom_function=CustomFunctionConfig(path=str(path)),
        num_workers=num_workers,
        timeout_s=timeout_s,
        error_score=ERROR_SCORE,
        max_logged_errors=5,
    )
    return RewardManager(CharTokenizer(), cfg, 24)


OUTER_TIMER_S = 20.0
WATCHDOG_S = 30.0


class OuterAlarm(BaseException):
    pass


@contextlib.contextmanager
def hang_watchdog(seconds: float = WATCHDOG_S) -> Iterator[None]:
    """If the body is still running after ``seconds`` (the timeout under test is broken), send SIGINT to the main
    thread once a second until it stops: a KeyboardInterrupt ends the run instead of a hang."""
    done = threading.Event()
    main = threading.main_thread().ident

    def watch() -> None:
        if done.wait(seconds):
            return
        while not done.wait(1.0):
            signal.pthread_kill(main, signal.SIGINT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def test_in_process_timeout_interrupts_and_restores_the_callers_alarm(
    slow_scorer_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    texts = ["forever", "ok", "swallow_exception", "swallow_once", "Answer: 3"]
    ids, mask = encode(texts, 24)
    outer_calls: list[int] = []

    def outer_handler(signum: int, frame: object) -> None:
        outer_calls.append(signum)
        raise OuterAlarm  # a BaseException: if timeouts did not work, this ends the test instead of a hang

    previous = signal.signal(signal.SIGALRM, outer_handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # blocked by the caller: unblocked only while scoring
    signal.setitimer(signal.ITIMER_REAL, OUTER_TIMER_S)
    try:
        manager = slow_manager(slow_scorer_file, 0, 0.5)
        with hang_watchdog(), caplog.at_level(logging.WARNING, logger=LOGGER):
            start = time.monotonic()
            res = manager(ids, mask, ["toy"] * 4 + ["math"], [""] * 4 + ["3"])
            elapsed = time.monotonic() - start
        remaining, interval = signal.getitimer(signal.ITIMER_REAL)
        handler = signal.getsignal(signal.SIGALRM)
        mask_after = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
        signal.signal(signal.SIGALRM, previous)
    assert 3 * 0.5 <= elapsed < 6  # three scorers each stopped at 0.5 s
    assert res.scores.tolist() == [ERROR_SCORE, 1.0, ERROR_SCORE, ERROR_SCORE, 1.0]
    assert res.metrics["reward/num_timeouts"] == 3.0 and res.metrics["reward/num_errors"] == 0.0
    # the caller's timer kept running (OUTER_TIMER_S minus the call), its handler and mask are back, it was never called
    assert OUTER_TIMER_S - elapsed - 1.0 < remaining <= OUTER_TIMER_S - elapsed and interval == 0.0
    assert handler is outer_handler and outer_calls == []
    assert signal.SIGALRM in mask_after
    messages = [r.getMessage() for r in caplog.records]
    assert sum(f"{slow_scorer_file}:compute_score exceeded reward.timeout_s=0.5 s" in m for m in messages) == 3
    assert all("data_source='toy'" in m for m in messages if "reward timeout" in m)


def test_pool_timeout(slow_scorer_file: Path) -> None:
    ids, mask = encode(["forever", "ok"], 16)
    with slow_manager(slow_scorer_file, 1, 0.5) as manager:
        executor = manager.pool.ensure_started()
        start = time.monotonic()
        res = manager(ids, mask, ["toy", "toy"], ["", ""])
        elapsed = time.monotonic() - start
        assert manager.pool.executor is executor  # interrupted inside the worker, not killed
    assert 0.5 <= elapsed < 5
    assert res.scores.tolist() == [ERROR_SCORE, 1.0]
    assert res.metrics["reward/num_timeouts"] == 1.0 and res.metrics["reward/num_errors"] == 0.0


def test_in_process_timeout_off_the_main_thread_warns_once(
    slow_scorer_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = slow_manager(slow_scorer_file, 0, 0.2)
    ids, mask = encode(["slow_ok"], 16)
    results = []

    def score_twice() -> None:
        for _ in range(2):
            results.append(manager(ids, mask, ["toy"], [""]))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        thread = threading.Thread(target=score_twice, name="scorer-thread")
        thread.start()
        thread.join(timeout=30)
    assert not thread.is_alive() and len(results) == 2
    # no timer off the main thread: the 0.5 s scorer ran to the end despite timeout_s=0.2
    assert [r.scores.tolist() for r in results] == [[1.0], [1.0]]
    assert all(r.metrics["reward/num_timeouts"] == 0.0 for r in results)
    warnings = [r.getMessage() for r in caplog.records if "is NOT enforced" in r.getMessage()]
    assert len(warnings) == 1 and "'scorer-thread'" in warnings[0] and "reward.num_workers >= 1" in warnings[0]
    # the same manager on the main thread does enforce it
    res = manager(ids, mask, ["toy"], [""])
    assert res.scores.tolist() == [ERROR_SCORE] and res.metrics["reward/num_timeouts"] == 1.0


def test_call_with_timeout_returns_and_leaves_no_alarm() -> None:
    before = signal.getsignal(signal.SIGALRM)
    assert custom.call_with_timeout(lambda: 42, 0.05) == 42
    time.sleep(0.1)  # an alarm left armed would fire here (default action: kill the process)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == before
    with pytest.raises(custom.ScorerTimeout):
        custom.call_with_timeout(lambda: time.sleep(10), 0.05)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == before
