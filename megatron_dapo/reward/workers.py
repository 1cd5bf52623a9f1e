"""Where the reward manager's scorers run, under what time limits, and how their failures are counted and logged.

:class:`ScorerPool` (``reward.num_workers >= 1``): a ``concurrent.futures.ProcessPoolExecutor`` (``forkserver``
start method where available, else ``spawn``; never ``fork``, since the caller holds threads) with
``reward.num_workers`` processes, created on first use and kept. At most one scorer per worker is in flight, so each
call's deadline is measured from its start. A scorer that runs past ``reward.timeout_s`` is interrupted inside the
worker (SIGALRM); one that does not return within ``timeout_s + hard_timeout_grace_s`` (stuck in C code, signals
blocked) has the pool killed and recreated, and the other in-flight calls are resubmitted. If a worker dies (the
scorer raised ``SystemExit`` past the worker's guard, called ``os._exit``, ran out of memory...), the calls that
were in flight are re-run one at a time, so only the culprit fails.

:class:`InlineScorer` (``reward.num_workers = 0``): in this process, with the same SIGALRM limit
(:func:`megatron_dapo.reward.custom.call_with_timeout`) when called from the main thread of the main interpreter;
from any other thread no timer can be armed, the call runs without a limit and a warning is logged once.

:class:`FailureLog`: counts the failed calls of a batch (``reward/num_errors``, ``reward/num_timeouts``), logs the
first ``reward.max_logged_errors`` of them with the data source, the function and the message, and logs once a
dropped ``acc``.

The worker processes import only :mod:`megatron_dapo.reward.custom` and :mod:`megatron_dapo.reward.math_dapo` (no
torch), plus the ``megatron_dapo`` package ``__init__``; the main module must be import-safe (guarded by
``if __name__ == "__main__"``), as for any spawn/forkserver pool.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_dapo.reward import custom

__all__ = ["WARMUP_TIMEOUT_S", "FailureLog", "InlineScorer", "ScorerPool", "ScoringCall"]

# the reward manager's messages, wherever they come from, go to one logger (the one users filter on)
logger = logging.getLogger("megatron_dapo.reward.manager")

WARMUP_TIMEOUT_S = 120.0

# (data_source, solution_str, ground_truth, extra_info) of one response
ScoringCall = tuple[str, str, Any, Optional[dict]]


# ------------------------------------------------------------------------------------------- in this process


class InlineScorer:
    """Scores in the calling process (``reward.num_workers = 0``), see the module docstring."""

    def __init__(self, custom_fn: custom.CombinedRewardFunction | None, timeout_s: float) -> None:
        self.custom_fn = custom_fn
        self.timeout_s = timeout_s
        self._warned_timeout_unenforced = False

    def run(self, kinds: Sequence[str], calls: Sequence[ScoringCall]) -> list[custom.Outcome]:
        """The outcome of every call, one after the other."""
        return [
            custom.score_response(kind, self.custom_fn, *call, self.timeout_s, self._warn_timeout_unenforced)
            for kind, call in zip(kinds, calls, strict=True)
        ]

    def _warn_timeout_unenforced(self) -> None:
        if self._warned_timeout_unenforced:
            return
        self._warned_timeout_unenforced = True
        logger.warning(
            "reward.timeout_s=%g is NOT enforced: in-process scoring (reward.num_workers=0) interrupts a scorer with "
            "SIGALRM, which works only in the main thread of the main interpreter, and the reward manager is called "
            "from thread %r. A scorer that never returns will hang this call; set reward.num_workers >= 1 to score "
            "in worker processes, whose time limit always holds. (Logged once.)",
            self.timeout_s,
            threading.current_thread().name,
        )


# ------------------------------------------------------------------------------------------- worker processes


@dataclass
class _PoolRun:
    """Bookkeeping of one :meth:`ScorerPool.run` call (indices into its items)."""

    kinds: Sequence[str]
    calls: Sequence[ScoringCall]
    labels: Sequence[str]  # each call's scorer, for messages
    outcomes: list[custom.Outcome | None]
    pending: deque[int]  # not yet submitted
    suspects: deque[int] = field(default_factory=deque)  # in flight when a worker died: re-run one at a time
    inflight: dict[Future, tuple[int, float]] = field(default_factory=dict)  # future -> (index, start time)
    solo: bool = False  # suspects are running, one at a time


class ScorerPool:
    """Worker processes that score responses, see the module docstring.

    Args:
        num_workers: processes (>= 1).
        specs: the custom reward functions every worker loads (:func:`megatron_dapo.reward.custom.init_worker`).
        timeout_s: the soft limit of one call (SIGALRM inside the worker).
        hard_timeout_grace_s: how long past ``timeout_s`` to wait before killing a worker whose scorer ignores the
            soft limit.
    """

    def __init__(
        self, num_workers: int, specs: Sequence[custom.RewardSpec], timeout_s: float, hard_timeout_grace_s: float
    ) -> None:
        self.num_workers = num_workers
        self.specs = list(specs)
        self.timeout_s = timeout_s
        self.hard_timeout_grace_s = hard_timeout_grace_s
        self.executor: ProcessPoolExecutor | None = None

    # ------------------------------------------------------------------ life cycle

    def ensure_started(self) -> ProcessPoolExecutor:
        """The running executor: a broken one is replaced, a missing one started with every worker up."""
        if self.executor is not None and getattr(self.executor, "_broken", False):
            self.kill()
        if self.executor is None:
            methods = multiprocessing.get_all_start_methods()
            executor = ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn"),
                initializer=custom.init_worker,
                initargs=(self.specs,),
            )
            self.executor = executor
            # start every worker now, so that process start-up never counts against a scorer's deadline
            warmup = [executor.submit(custom.warmup, 0.05) for _ in range(self.num_workers)]
            done, not_done = wait(warmup, timeout=WARMUP_TIMEOUT_S)
            if not_done or any(f.exception() is not None for f in done):
                self.kill()
                raise RuntimeError(f"reward worker processes did not start within {WARMUP_TIMEOUT_S:.0f} s")
        return self.executor

    def kill(self) -> None:
        """Kill the worker processes at once and forget the executor (a later call starts new ones)."""
        executor, self.executor = self.executor, None
        if executor is None:
            return
        processes = list(getattr(executor, "_processes", {}).values())
        for proc in processes:
            if proc.is_alive():
                proc.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            proc.join(timeout=5)

    def close(self) -> None:
        """Stop the worker processes, letting them finish (a later call starts new ones)."""
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        if getattr(self, "executor", None) is not None:
            with contextlib.suppress(Exception):  # best effort, possibly at interpreter shutdown
                self.kill()

    # ------------------------------------------------------------------ scoring

    def run(self, kinds: Sequence[str], calls: Sequence[ScoringCall], labels: Sequence[str]) -> list[custom.Outcome]:
        """The outcome of every call, at most one in flight per worker.

        A worker death (``BrokenProcessPool``) fails every call in flight; those items are re-run one at a time
        ("suspects"), so only the item that kills its worker when alone is scored as an error. A call still running
        at the hard deadline has the pool restarted (:meth:`_restart_stuck`).
        """
        run = _PoolRun(kinds, calls, labels, outcomes=[None] * len(kinds), pending=deque(range(len(kinds))))
        hard_s = self.timeout_s + self.hard_timeout_grace_s if self.timeout_s > 0 else None
        while run.pending or run.suspects or run.inflight:
            executor = self.ensure_started()
            if not run.inflight:
                run.solo = bool(run.suspects)
            try:
                self._submit(executor, run)
            except BrokenProcessPool:
                self.kill()
                continue
            if not run.inflight:
                continue
            wait_s = None
            if hard_s is not None:
                wait_s = max(0.0, min(start for _, start in run.inflight.values()) + hard_s - time.monotonic())
            done, _ = wait(list(run.inflight), timeout=wait_s, return_when=FIRST_COMPLETED)
            for fut in done:
                i, _ = run.inflight.pop(fut)
                self._settle(fut, i, run)
            if hard_s is not None:
                self._restart_stuck(run, hard_s)
        return [o if o is not None else ("error", "not scored") for o in run.outcomes]

    def _submit(self, executor: ProcessPoolExecutor, run: _PoolRun) -> None:
        """Fill the free worker slots (a single slot while suspects run alone); on ``BrokenProcessPool`` the item
        goes back to its queue and the error propagates."""
        queue = run.suspects if run.solo else run.pending
        while len(run.inflight) < (1 if run.solo else self.num_workers) and queue:
            i = queue.popleft()
            try:
                fut = executor.submit(custom.run_scorer, run.kinds[i], *run.calls[i], self.timeout_s)
            except BrokenProcessPool:
                queue.appendleft(i)
                raise
            run.inflight[fut] = (i, time.monotonic())

    def _settle(self, fut: Future, i: int, run: _PoolRun) -> None:
        """Record the outcome of finished call ``i``; if its worker died, ``i`` becomes a suspect (an error when it
        already ran alone)."""
        try:
            run.outcomes[i] = fut.result()
        except BrokenProcessPool:
            if run.solo:
                run.outcomes[i] = ("error", "the reward worker process died while scoring this response")
            else:
                run.suspects.append(i)
        except custom.ScorerTimeout:  # the alarm fired as the worker was returning
            run.outcomes[i] = (
                "timeout",
                f"reward function {run.labels[i]} exceeded reward.timeout_s={self.timeout_s:g} s",
            )
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            run.outcomes[i] = ("error", f"{type(exc).__name__}: {exc}")

    def _restart_stuck(self, run: _PoolRun, hard_s: float) -> None:
        """If a call has run past the hard deadline ``hard_s``: score it as a timeout, kill and forget the pool, and
        queue the other unfinished calls again (innocent bystanders)."""
        now = time.monotonic()
        expired = [fut for fut, (_, start) in run.inflight.items() if now - start >= hard_s and not fut.done()]
        if not expired:
            return
        for fut in expired:
            i, _ = run.inflight.pop(fut)
            run.outcomes[i] = (
                "timeout",
                f"reward function {run.labels[i]} did not return within {hard_s:.1f} s "
                f"(reward.timeout_s={self.timeout_s:g} plus a grace period); its worker was killed",
            )
        logger.warning("reward worker stuck past the hard deadline (%.1f s); restarting the pool", hard_s)
        for fut, (i, _) in list(run.inflight.items()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                run.outcomes[i] = fut.result()
            else:
                run.pending.appendleft(i)  # score it again in the new pool
        run.inflight.clear()
        self.kill()


# ------------------------------------------------------------------------------------------- failures


class FailureLog:
    """Counts and logs the failed calls of each batch (see the module docstring).

    Args:
        max_logged_errors: ``reward.max_logged_errors``, failures logged per batch.
        error_score: ``reward.error_score``, named in the messages (the score a failed call gets).
    """

    def __init__(self, max_logged_errors: int, error_score: float) -> None:
        self.max_logged_errors = max_logged_errors
        self.error_score = error_score
        self._warned_acc = False

    def report(
        self, outcomes: Sequence[custom.Outcome], data_sources: Sequence[str], labels: Sequence[str]
    ) -> tuple[int, int]:
        """``(num_errors, num_timeouts)`` of a batch's outcomes; the first ``max_logged_errors`` failures are
        logged, the rest summarised in one line, and a dropped ``acc`` is logged once per manager."""
        num_errors = num_timeouts = logged = 0
        for i, (status, payload) in enumerate(outcomes):
            if status == "ok":
                note = payload[1]
                if note is not None and not self._warned_acc:
                    self._warned_acc = True
                    logger.warning("%s (data_source=%r; logged once)", note, data_sources[i])
                continue
            if status == "timeout":
                num_timeouts += 1
            else:
                num_errors += 1
            if logged < self.max_logged_errors:
                logged += 1
                logger.warning(
                    "reward %s for response %d (data_source=%r, function %s); scoring it %s:\n%s",
                    "timeout" if status == "timeout" else "error",
                    i,
                    data_sources[i],
                    labels[i],
                    self.error_score,
                    payload,
                )
        if logged < num_errors + num_timeouts:
            logger.warning(
                "reward: %d more failures not logged (reward.max_logged_errors=%d)",
                num_errors + num_timeouts - logged,
                self.max_logged_errors,
            )
        return num_errors, num_timeouts
