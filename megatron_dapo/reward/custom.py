"""User reward functions loaded from Python files, their weighted combination, and the worker-side scorer entry.

A reward function has the signature ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
(called with keyword arguments); a dict result must contain ``"score"`` and may carry more keys (``acc``,
``pred``, ...) that end up in the reward manager's ``extra``.

This module imports no third-party package: it is what reward worker processes import.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from megatron_dapo.reward import math_dapo

__all__ = [
    "CombinedRewardFunction",
    "RewardFunction",
    "RewardSpec",
    "ScorerTimeout",
    "build_reward_function",
    "combine",
    "init_worker",
    "load_reward_function",
    "run_scorer",
    "warmup",
]

RewardFunction = Callable[..., Any]
RewardSpec = tuple[str, str, float]  # (path, function name, weight)

_MODULE_CACHE: dict[str, Any] = {}


def _load_module(path: str) -> Any:
    abspath = os.path.abspath(os.path.expanduser(path))
    if abspath in _MODULE_CACHE:
        return _MODULE_CACHE[abspath]
    if not os.path.isfile(abspath):
        raise FileNotFoundError(f"reward function file {path!r} does not exist (resolved to {abspath})")
    module_name = "_megatron_dapo_reward_" + hashlib.sha1(abspath.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, abspath)
    if spec is None or spec.loader is None:
        raise ImportError(f"reward function file {abspath} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets functions defined there be pickled by reference
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing reward function file {abspath} failed: {exc!r}") from exc
    _MODULE_CACHE[abspath] = module
    return module


def load_reward_function(path: str, name: str = "compute_score") -> RewardFunction:
    """Load function ``name`` from the Python file ``path``.

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: the file cannot be imported (the cause is chained).
        AttributeError: the file defines no attribute ``name`` (the message lists the functions it does define).
        TypeError: the attribute exists but is not callable.
    """
    if not path:
        raise FileNotFoundError("reward function path is empty; set reward.custom_function.path")
    module = _load_module(path)
    if not hasattr(module, name):
        candidates = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"reward function file {path!r} has no function {name!r}; callables defined there: "
            f"{', '.join(candidates) or '(none)'}. Set reward.custom_function.name accordingly."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in reward function file {path!r} is a {type(fn).__name__}, not a function")
    return fn


def _score_of(result: Any, label: str) -> float:
    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"reward function {label} returned a dict without a 'score' key: {sorted(result)}")
        return float(result["score"])
    return float(result)


class CombinedRewardFunction:
    """Weighted sum of reward functions (picklable if the functions are).

    One function: its result with ``score`` multiplied by the weight (a dict stays a dict, a float a float).
    Several: a dict with ``score = sum_i w_i * score_i``, ``score_<i>`` = each function's unweighted score (``i``
    in list order), and the other keys of dict results merged (the first function providing a key wins).
    """

    def __init__(self, functions_with_weights: Sequence[tuple[RewardFunction, float]]) -> None:
        if not functions_with_weights:
            raise ValueError("combine() needs at least one (function, weight) pair")
        for fn, weight in functions_with_weights:
            if not callable(fn):
                raise TypeError(f"{fn!r} is not callable")
            float(weight)
        self.functions_with_weights = [(fn, float(w)) for fn, w in functions_with_weights]

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float | dict[str, Any]:
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
        if len(self.functions_with_weights) == 1:
            fn, weight = self.functions_with_weights[0]
            result = fn(**kwargs)
            if isinstance(result, dict):
                return {**result, "score": _score_of(result, getattr(fn, "__name__", "0")) * weight}
            return float(result) * weight
        total = 0.0
        merged: dict[str, Any] = {}
        for i, (fn, weight) in enumerate(self.functions_with_weights):
            result = fn(**kwargs)
            score = _score_of(result, getattr(fn, "__name__", str(i)))
            total += weight * score
            merged[f"score_{i}"] = score
            if isinstance(result, dict):
                for key, value in result.items():
                    if key != "score":
                        merged.setdefault(key, value)
        merged["score"] = total
        return merged


def combine(functions_with_weights: Sequence[tuple[RewardFunction, float]]) -> CombinedRewardFunction:
    """Combine ``[(fn, weight), ...]`` into one reward function, see :class:`CombinedRewardFunction`."""
    return CombinedRewardFunction(functions_with_weights)


def build_reward_function(specs: Sequence[RewardSpec]) -> CombinedRewardFunction | None:
    """Load and combine ``[(path, name, weight), ...]``; None when ``specs`` is empty."""
    if not specs:
        return None
    return combine([(load_reward_function(path, name), weight) for path, name, weight in specs])


# ------------------------------------------------------------------------------------------- worker side

_WORKER_FN: CombinedRewardFunction | None = None
_WORKER_INIT_ERROR: str | None = None


class ScorerTimeout(Exception):
    """Raised inside a scorer that ran past its time limit (soft timeout, SIGALRM)."""


def init_worker(specs: Sequence[RewardSpec]) -> None:
    """Process-pool initializer: load the custom reward functions once per worker process."""
    global _WORKER_FN, _WORKER_INIT_ERROR
    try:
        _WORKER_FN = build_reward_function(specs)
        _WORKER_INIT_ERROR = None
    except Exception:  # noqa: BLE001 - reported by every custom call in this worker
        _WORKER_FN = None
        _WORKER_INIT_ERROR = traceback.format_exc()


def warmup(delay: float) -> int:
    """No-op task used to start every worker of a fresh pool."""
    time.sleep(delay)
    return os.getpid()


def _on_alarm(signum: int, frame: Any) -> None:
    raise ScorerTimeout("reward function exceeded its time limit")


def _call(kind: str, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> Any:
    if kind == "math_dapo":
        return math_dapo.compute_score(solution_str, ground_truth)
    if kind == "custom":
        if _WORKER_FN is None:
            raise RuntimeError(f"custom reward functions failed to load in the worker:\n{_WORKER_INIT_ERROR}")
        return _WORKER_FN(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )
    raise ValueError(f"unknown scorer kind {kind!r}")


def run_scorer(
    kind: str,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None,
    timeout_s: float,
) -> tuple[str, Any]:
    """Score one response; never raises. Returns ``("ok", result)``, ``("error", traceback)`` or
    ``("timeout", message)``.

    In a process's main thread a positive ``timeout_s`` arms a SIGALRM timer that interrupts the scorer (soft
    timeout; the reward manager also enforces a hard deadline by killing the worker, for code that does not return
    to the interpreter).
    """
    use_alarm = timeout_s > 0 and threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    previous = None
    if use_alarm:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # an earlier scorer may have blocked it
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return "ok", _call(kind, data_source, solution_str, ground_truth, extra_info)
    except ScorerTimeout:
        return "timeout", f"reward function exceeded timeout_s={timeout_s}"
    except BaseException:  # noqa: BLE001 - a scorer must never take the worker down (SystemExit included)
        return "error", traceback.format_exc()
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
