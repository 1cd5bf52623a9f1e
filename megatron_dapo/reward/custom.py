"""User reward functions loaded from Python files, their weighted combination, result checks, time limits and the
worker-side scorer entry.

A reward function has the signature ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
(called with keyword arguments). Its result must be a finite number or a dict whose ``"score"`` is one; a dict may
carry more keys (``acc``, ``pred``, ...) that end up in the reward manager's ``extra``.

Accepted scores: ``int`` and ``float`` (and other ``numbers.Real`` such as ``fractions.Fraction``), numpy integer
and floating scalars, and 0-dim numeric numpy arrays or torch tensors; each is converted to a Python ``float``.
Anything else raises :class:`InvalidRewardError`, whose message names the function and shows the value: NaN, +inf,
-inf, ``None``, a bool (a scorer returning ``True`` almost always meant ``acc``), a string, a list, a dict without a
``"score"`` key, or a dict whose score is any of these. ``acc`` must be a bool or 0/1 (Python, numpy or 0-dim
torch); any other value is treated as missing (None). Without an ``acc``, a score of exactly 0 or 1 gives
``acc`` False / True and any other score gives None.

Time limits (:func:`call_with_timeout`): in the main thread of the main interpreter a SIGALRM timer
(``setitimer``, so sub-second limits work) raises :class:`ScorerTimeout` inside a scorer that runs past its limit,
and repeats every :data:`ALARM_REPEAT_S` until the scorer has unwound, so a scorer that swallows one interruption
still stops. :class:`ScorerTimeout` derives from ``BaseException``, so ``except Exception`` in a scorer does not
catch it. What no signal can stop is code that never returns to the interpreter (a C extension looping without
checking for signals, or code that blocks SIGALRM and never unblocks it): in-process, such a scorer hangs its
caller; the reward manager's worker pool kills and recreates the worker after a hard deadline. The previous SIGALRM
handler, signal mask and timer are restored afterwards (a pending outer timer keeps its remaining time). In any
other thread no timer can be armed: the call runs without a limit and ``on_unenforced`` is called.

This module imports no third-party package: it is what reward worker processes import.
"""

from __future__ import annotations

import math
import numbers
import os
import reprlib
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from megatron_dapo.reward import math_dapo
from megatron_dapo.user_code import load_python_file

__all__ = [
    "ALARM_REPEAT_S",
    "CombinedRewardFunction",
    "InvalidRewardError",
    "Outcome",
    "RewardFunction",
    "RewardSpec",
    "ScorerTimeout",
    "as_acc",
    "build_reward_function",
    "call_with_timeout",
    "combine",
    "finite_score",
    "function_label",
    "init_worker",
    "load_reward_function",
    "normalise_result",
    "run_scorer",
    "score_response",
    "short_repr",
    "warmup",
]

RewardFunction = Callable[..., Any]
RewardSpec = tuple[str, str, float]  # (path, function name, weight)
# what scoring one response gave (score_response): ("ok", (row, note)), ("error", message) or ("timeout", message)
Outcome = tuple[str, Any]
T = TypeVar("T")

MATH_DAPO_LABEL = "math_dapo"
# after a timeout, how often the alarm fires again while the scorer is still unwinding (it may have caught one)
ALARM_REPEAT_S = 0.1
_EXPECTED = "expected a finite int or float (or a dict whose 'score' is one)"
_MAX_REPR_CHARS = 200


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
    module = load_python_file(path, "reward function file")
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


# ------------------------------------------------------------------------------------------- result checks


class InvalidRewardError(ValueError):
    """A reward function returned something that is not a finite score (the message names the function and
    shows the value)."""


_REPR = reprlib.Repr()
_REPR.maxstring = 120
_REPR.maxother = 120
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few hundred characters (a scorer's result may be arbitrarily large)."""
    try:
        text = _REPR.repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not hide the real problem
        text = f"<{type(value).__name__} whose repr() raised {type(exc).__name__}>"
    return text if len(text) <= _MAX_REPR_CHARS else text[: _MAX_REPR_CHARS - 3] + "..."


def function_label(fn: Any) -> str:
    """``<file of fn's module>:<qualified name>`` (e.g. ``/data/my_reward.py:compute_score``), for messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return short_repr(fn)
    module_name = getattr(fn, "__module__", None)
    path = getattr(sys.modules.get(module_name or ""), "__file__", None) or module_name
    return f"{path}:{name}" if path else str(name)


def _unwrap_scalar(value: Any) -> Any:
    """A numpy scalar, or a 0-dim numpy array or torch tensor, as the Python object it holds; else ``value``.

    numpy and torch are looked up in ``sys.modules`` rather than imported: a value of their types can only exist
    if they are already imported, and worker processes must not import them.
    """
    numpy = sys.modules.get("numpy")
    if numpy is not None and (
        isinstance(value, numpy.generic) or (isinstance(value, numpy.ndarray) and value.ndim == 0)
    ):
        return value.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


def _as_finite_float(value: Any) -> tuple[float | None, str]:
    """``(float, "")`` for a finite real number (see the module docstring), else ``(None, what value is)``."""
    value = _unwrap_scalar(value)
    if isinstance(value, bool):
        return None, "a bool, not a number"
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except (OverflowError, TypeError, ValueError):
            return None, "a number that does not fit in a float"
        return (number, "") if math.isfinite(number) else (None, "a non-finite number")
    if value is None:
        return None, "None"
    return None, f"a {type(value).__name__}, not a number"


def finite_score(result: Any, label: str) -> float:
    """The score of a reward function's ``result`` (a number, or a dict with ``"score"``) as a finite float.

    Raises:
        InvalidRewardError: naming ``label`` (the function) and showing the offending value.
    """
    if isinstance(result, Mapping):
        if "score" not in result:
            raise InvalidRewardError(
                f"reward function {label} returned a dict without a 'score' key: {short_repr(result)}; {_EXPECTED}"
            )
        number, problem = _as_finite_float(result["score"])
        if number is None:
            raise InvalidRewardError(
                f"reward function {label} returned a dict whose 'score' is {problem}: "
                f"{short_repr(result['score'])} (in {short_repr(result)}); {_EXPECTED}"
            )
        return number
    number, problem = _as_finite_float(result)
    if number is None:
        raise InvalidRewardError(f"reward function {label} returned {problem}: {short_repr(result)}; {_EXPECTED}")
    return number


def as_acc(value: Any) -> bool | None:
    """``acc`` as a bool: a bool or a number equal to 0 or 1 (Python, numpy or 0-dim torch); else None."""
    value = _unwrap_scalar(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real) and value in (0, 1):  # NaN equals neither
        return bool(value)
    return None


def normalise_result(result: Any, label: str) -> tuple[dict[str, Any], str | None]:
    """A reward function's result as a row ``{"score": finite float, "acc": bool | None, ...other dict keys}``.

    Returns:
        ``(row, note)``: ``note`` says why a given ``acc`` was dropped (it was not a bool or 0/1), else None.

    Raises:
        InvalidRewardError: the score is not a finite number (see :func:`finite_score`).
    """
    score = finite_score(result, label)
    if not isinstance(result, Mapping):
        return {"score": score, "acc": as_acc(score)}, None
    row = dict(result)
    row["score"] = score
    note = None
    if "acc" in row:
        raw_acc = row["acc"]
        row["acc"] = as_acc(raw_acc)
        if row["acc"] is None and raw_acc is not None:
            note = (
                f"reward function {label} returned acc={short_repr(raw_acc)}; acc must be a bool or 0/1, so it is "
                "treated as missing (None)"
            )
    else:
        row["acc"] = as_acc(score)
    return row, note


# ------------------------------------------------------------------------------------------- combination


class CombinedRewardFunction:
    """Weighted sum of reward functions (picklable if the functions are).

    One function: its result with ``score`` multiplied by the weight (a dict stays a dict, a number becomes a
    float). Several: a dict with ``score = sum_i w_i * score_i``, ``score_<i>`` = each function's unweighted score
    (``i`` in list order), and the other keys of dict results merged (the first function providing a key wins).
    Every function's score is checked with :func:`finite_score` (so an error names the function at fault), and so
    is the weighted result (it can overflow).
    """

    def __init__(self, functions_with_weights: Sequence[tuple[RewardFunction, float]]) -> None:
        if not functions_with_weights:
            raise ValueError("combine() needs at least one (function, weight) pair")
        checked: list[tuple[RewardFunction, float]] = []
        for fn, weight in functions_with_weights:
            if not callable(fn):
                raise TypeError(f"{fn!r} is not callable")
            w = float(weight)
            if not math.isfinite(w):
                raise ValueError(f"the weight of reward function {function_label(fn)} must be finite, got {weight!r}")
            checked.append((fn, w))
        self.functions_with_weights = checked
        self.labels = [function_label(fn) for fn, _ in checked]

    def describe(self) -> str:
        """The function's label, or ``w0 * label0 + w1 * label1 ...`` for a combination (for messages)."""
        if len(self.labels) == 1:
            return self.labels[0]
        return " + ".join(f"{w:g} * {label}" for (_, w), label in zip(self.functions_with_weights, self.labels))

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
            score = finite_score(result, self.labels[0]) * weight
            if not math.isfinite(score):
                raise InvalidRewardError(
                    f"reward function {self.labels[0]}: its score times reward weight {weight:g} is not finite "
                    f"({score}); result {short_repr(result)}"
                )
            return {**result, "score": score} if isinstance(result, Mapping) else score
        total = 0.0
        merged: dict[str, Any] = {}
        for i, (fn, weight) in enumerate(self.functions_with_weights):
            result = fn(**kwargs)
            score = finite_score(result, self.labels[i])
            total += weight * score
            merged[f"score_{i}"] = score
            if isinstance(result, Mapping):
                for key, value in result.items():
                    if key != "score":
                        merged.setdefault(key, value)
        if not math.isfinite(total):
            scores = [merged[f"score_{i}"] for i in range(len(self.functions_with_weights))]
            raise InvalidRewardError(f"the weighted sum {self.describe()} is not finite ({total}); scores {scores}")
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


# ------------------------------------------------------------------------------------------- time limits


class ScorerTimeout(BaseException):
    """Raised inside a scorer that ran past its time limit (SIGALRM).

    A ``BaseException`` (like ``KeyboardInterrupt``): a scorer's ``except Exception`` must not swallow it.
    """


class _AlarmDeadline:
    """A SIGALRM timer raising :class:`ScorerTimeout`; :meth:`disarm` restores the handler, mask and timer found."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.active = False  # the handler raises only while True
        self.handler_installed = False
        self.previous_handler: Any = None
        self.previous_mask: set[signal.Signals] | None = None
        self.previous_timer: tuple[float, float] | None = None
        self.armed_at = 0.0

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self.active:
            raise ScorerTimeout(f"reward function exceeded its time limit of {self.timeout_s:g} s")

    def arm(self) -> bool:
        """Start the timer; False (nothing changed) where signals cannot be used: not the main thread of the main
        interpreter, or a platform without ``setitimer``."""
        if not hasattr(signal, "setitimer"):
            return False
        try:
            self.previous_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        except ValueError:  # "signal only works in main thread of the main interpreter"
            return False
        self.handler_installed = True
        self.previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
        self.active = True
        self.armed_at = time.monotonic()
        self.previous_timer = signal.setitimer(signal.ITIMER_REAL, self.timeout_s, ALARM_REPEAT_S)
        return True

    def disarm(self) -> None:
        self.active = False
        if self.previous_timer is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if self.handler_installed:
            # a handler installed from C cannot be restored from Python (signal.signal returned None)
            signal.signal(
                signal.SIGALRM, self.previous_handler if self.previous_handler is not None else signal.SIG_DFL
            )
        if self.previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        if self.previous_timer is not None and self.previous_timer[0] > 0:
            delay, interval = self.previous_timer
            remaining = delay - (time.monotonic() - self.armed_at)
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6), interval)  # an overdue timer fires now


def call_with_timeout(fn: Callable[[], T], timeout_s: float, on_unenforced: Callable[[], None] | None = None) -> T:
    """``fn()``, interrupted with :class:`ScorerTimeout` after ``timeout_s`` seconds (see the module docstring).

    Where no timer can be armed (not the main thread of the main interpreter) ``fn`` runs without a limit and
    ``on_unenforced()`` is called first. ``timeout_s <= 0`` means no limit.
    """
    deadline = _AlarmDeadline(timeout_s)
    try:
        if timeout_s > 0 and not deadline.arm() and on_unenforced is not None:
            on_unenforced()
        return fn()
    finally:
        deadline.active = False  # before any call: an alarm handled from here on is a no-op
        deadline.disarm()


# ------------------------------------------------------------------------------------------- scoring one response


def score_response(
    kind: str,
    custom_fn: CombinedRewardFunction | None,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None,
    timeout_s: float,
    on_unenforced: Callable[[], None] | None = None,
) -> Outcome:
    """Score one response with the built-in scorer (``kind="math_dapo"``) or ``custom_fn`` (``kind="custom"``).

    Returns:
        ``("ok", (row, note))`` with ``row``/``note`` from :func:`normalise_result`; ``("error", message)`` for an
        exception (its traceback) or an invalid result (which function, which value); ``("timeout", message)``.
        Exceptions other than ``Exception`` subclasses (``KeyboardInterrupt``, ``SystemExit``) propagate.
    """
    label = MATH_DAPO_LABEL if kind == "math_dapo" else (custom_fn.describe() if custom_fn is not None else kind)

    def call() -> Any:
        if kind == "math_dapo":
            return math_dapo.compute_score(solution_str, ground_truth)
        if kind != "custom":
            raise ValueError(f"unknown scorer kind {kind!r}; expected 'math_dapo' or 'custom'")
        if custom_fn is None:
            raise RuntimeError(f"no custom reward function is configured for data_source {data_source!r}")
        return custom_fn(
            data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
        )

    try:
        result = call_with_timeout(call, timeout_s, on_unenforced)
        return "ok", normalise_result(result, label)
    except ScorerTimeout:
        return timeout_outcome(label, timeout_s)
    except InvalidRewardError as exc:
        return "error", str(exc)
    except Exception:  # noqa: BLE001 - the reward manager counts and logs it
        return "error", traceback.format_exc()


# ------------------------------------------------------------------------------------------- worker side

_WORKER_FN: CombinedRewardFunction | None = None
_WORKER_INIT_ERROR: str | None = None


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


def run_scorers(calls: list[tuple], timeout_s: float) -> list[Outcome]:
    """Worker entry for a task of several calls, ``(kind, label, data_source, solution_str, ground_truth,
    extra_info)`` each: :func:`run_scorer` one after the other, each under its own time limit; never raises."""
    outcomes: list[Outcome] = []
    for kind, label, *call in calls:
        try:
            outcomes.append(run_scorer(kind, *call, timeout_s))
        except ScorerTimeout:  # the alarm fired as the call was returning
            outcomes.append(timeout_outcome(label, timeout_s))
    return outcomes


def timeout_outcome(label: str, timeout_s: float) -> Outcome:
    """The outcome of a call of reward function ``label`` interrupted at ``reward.timeout_s``."""
    return "timeout", f"reward function {label} exceeded reward.timeout_s={timeout_s:g} s"


def run_scorer(
    kind: str,
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None,
    timeout_s: float,
) -> Outcome:
    """Worker entry: :func:`score_response` with this worker's custom functions; never raises.

    Pool workers run tasks in their main thread, so the SIGALRM limit applies (soft timeout); the reward manager
    also enforces a hard deadline by killing the worker, for code that does not return to the interpreter.
    """
    if kind == "custom" and _WORKER_FN is None:
        return "error", f"custom reward functions failed to load in the worker:\n{_WORKER_INIT_ERROR}"
    try:
        return score_response(kind, _WORKER_FN, data_source, solution_str, ground_truth, extra_info, timeout_s)
    except BaseException:  # noqa: BLE001 - a scorer must never take the worker down (SystemExit included)
        return "error", traceback.format_exc()
