"""Where the reward manager's scorers run, under what time limits, and how their failures are counted and logged.

:class:`ScorerPool` (``reward.num_workers >= 1``): a ``concurrent.futures.ProcessPoolExecutor`` (``forkserver``
start method where available, else ``spawn``; never ``fork``, since the caller holds threads) with
``reward.num_workers`` processes, created on first use and kept. At most one task per worker is in flight, so a
task's deadline is measured from its start; a task is one call, or up to ``MAX_CALLS_PER_TASK`` while calls wait for
a worker (``chunk_size``: this process's bookkeeping, about half a millisecond a task, is then shared). A scorer that
runs past ``reward.timeout_s`` is interrupted inside the worker (SIGALRM); a task that does not return within
``calls x timeout_s + hard_timeout_grace_s`` (a scorer stuck in C code, signals blocked) has the pool killed and
recreated, and the other in-flight calls are resubmitted; a stuck task of several calls has them re-run one at a
time, so only the stuck one is scored a timeout. If a worker dies (the scorer raised ``SystemExit`` past the
worker's guard, called ``os._exit``, ran out of memory...), the calls that were in flight are re-run one at a time,
so only the culprit fails. Calls go through a :class:`PoolSession`, whose thread drives the pool: all at once
(:meth:`ScorerPool.run`), or one by one while the caller does other work (the engine generating:
``reward.overlap_generation``).

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

__all__ = [
    "MAX_CALLS_PER_TASK",
    "WARMUP_TIMEOUT_S",
    "FailureLog",
    "InlineScorer",
    "PoolSession",
    "ScorerPool",
    "ScoringCall",
    "chunk_size",
]

# the reward manager's messages, wherever they come from, go to one logger (the one users filter on)
logger = logging.getLogger("megatron_dapo.reward.manager")

WARMUP_TIMEOUT_S = 120.0
MAX_CALLS_PER_TASK = 16  # a worker's task: a few ms of this process's bookkeeping shared by up to this many calls

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
    """Bookkeeping of one scoring session (indices into its items, which may still grow)."""

    kinds: list[str] = field(default_factory=list)
    calls: list[ScoringCall] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # each call's scorer, for messages
    outcomes: list[custom.Outcome | None] = field(default_factory=list)
    pending: deque[int] = field(default_factory=deque)  # not yet submitted
    suspects: deque[int] = field(default_factory=deque)  # in flight when a worker died: re-run one at a time
    inflight: dict[Future, tuple[list[int], float]] = field(default_factory=dict)  # task -> (its calls, start)
    solo: bool = False  # suspects are running, one at a time

    def busy(self) -> bool:
        return bool(self.pending or self.suspects or self.inflight)


class PoolSession:
    """Calls scored in the pool while the caller does other work (the engine generates). A thread of this process
    drives the pool: it hands each free worker the next call, settles the calls that finish and enforces the hard
    deadline, so the workers stay busy whatever the caller is doing. ``add`` queues a call, ``settled`` counts the
    outcomes in, ``finish`` waits for every outcome."""

    def __init__(self, pool: ScorerPool) -> None:
        self.pool = pool
        self.run = _PoolRun()
        self._lock = threading.Lock()
        self._wakeup: Future = Future()  # resolved to wake the driver (a call added, the session closing)
        self._closing = False
        self._error: Optional[BaseException] = None
        self._driver: Optional[threading.Thread] = None

    def add(self, kind: str, call: ScoringCall, label: str) -> None:
        with self._lock:
            run = self.run
            run.pending.append(len(run.kinds))
            run.kinds.append(kind)
            run.calls.append(call)
            run.labels.append(label)
            run.outcomes.append(None)
            self._poke()
        if self._driver is None:
            self._driver = threading.Thread(target=self._drive, name="reward-pool-driver", daemon=True)
            self._driver.start()

    def settled(self) -> int:
        """How many calls have their outcome already."""
        with self._lock:
            return sum(o is not None for o in self.run.outcomes)

    def finish(self) -> list[custom.Outcome]:
        """The outcome of every call added, in order."""
        with self._lock:
            self._closing = True
            self._poke()
        if self._driver is not None:
            self._driver.join()
        if self._error is not None:
            raise self._error
        return [o if o is not None else ("error", "not scored") for o in self.run.outcomes]

    def _poke(self) -> None:
        if not self._wakeup.done():
            self._wakeup.set_result(None)

    def _drive(self) -> None:
        """Until the session is closed and every call settled: fill the free workers, wait for a call to finish, a
        call to be added or the first hard deadline, settle."""
        pool, run = self.pool, self.run
        try:
            while True:
                with self._lock:
                    if self._wakeup.done():
                        self._wakeup = Future()
                    if not run.busy() and self._closing:
                        return
                    futures, wait_s = pool._fill(run) if run.busy() else ([], None)
                    wakeup = self._wakeup
                done, _ = wait([*futures, wakeup], timeout=wait_s, return_when=FIRST_COMPLETED)
                with self._lock:
                    pool._collect(run, done)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller, by finish()
            self._error = exc


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

    def session(self) -> PoolSession:
        """A session to add calls to while doing other work (:class:`PoolSession`)."""
        return PoolSession(self)

    def run(self, kinds: Sequence[str], calls: Sequence[ScoringCall], labels: Sequence[str]) -> list[custom.Outcome]:
        """The outcome of every call, at most one in flight per worker (a session whose calls are all added at
        once)."""
        session = self.session()
        for kind, call, label in zip(kinds, calls, labels, strict=True):
            session.add(kind, call, label)
        return session.finish()

    def _fill(self, run: _PoolRun) -> tuple[list[Future], Optional[float]]:
        """Submit to the free workers; the tasks in flight and how long until the first one's hard deadline (None:
        no deadline). A worker death (``BrokenProcessPool``) fails every call in flight; those items are re-run one
        at a time ("suspects"), so only the item that kills its worker when alone is scored as an error."""
        executor = self.ensure_started()
        if not run.inflight:
            run.solo = bool(run.suspects)
        try:
            self._submit(executor, run)
        except BrokenProcessPool:
            self.kill()
            return [], 0.0
        if not run.inflight:
            return [], 0.0  # suspects wait for the calls in flight to settle: the next round runs them alone
        if self.timeout_s <= 0:
            return list(run.inflight), None
        now = time.monotonic()
        first = min(start + self._hard_s(len(chunk)) - now for chunk, start in run.inflight.values())
        return list(run.inflight), max(0.0, first)

    def _collect(self, run: _PoolRun, done: set[Future]) -> None:
        """Settle the tasks in ``done``; a task still running at its hard deadline has the pool restarted
        (:meth:`_restart_stuck`)."""
        for fut in done:
            if fut in run.inflight:
                chunk, _ = run.inflight.pop(fut)
                self._settle(fut, chunk, run)
        if self.timeout_s > 0:
            self._restart_stuck(run)

    def _hard_s(self, calls: int) -> float:
        """The hard deadline of a task of ``calls`` calls, from its submission."""
        return calls * self.timeout_s + self.hard_timeout_grace_s

    def _submit(self, executor: ProcessPoolExecutor, run: _PoolRun) -> None:
        """Fill the free worker slots (a single slot while suspects run alone), a task of one call each, or of several
        (``chunk_size``) while calls wait for a worker, so that the pool's per-task cost in this process is shared;
        on ``BrokenProcessPool`` the task's calls go back to their queue and the error propagates."""
        queue = run.suspects if run.solo else run.pending
        while len(run.inflight) < (1 if run.solo else self.num_workers) and queue:
            size = 1 if run.solo else chunk_size(len(queue), self.num_workers)
            chunk = [queue.popleft() for _ in range(size)]
            calls = [(run.kinds[i], run.labels[i], *run.calls[i]) for i in chunk]
            try:
                fut = executor.submit(custom.run_scorers, calls, self.timeout_s)
            except BrokenProcessPool:
                queue.extendleft(reversed(chunk))
                raise
            run.inflight[fut] = (chunk, time.monotonic())

    def _settle(self, fut: Future, chunk: list[int], run: _PoolRun) -> None:
        """Record the outcomes of a finished task; if its worker died, its calls become suspects (an error for a call
        that already ran alone)."""
        try:
            outcomes = fut.result()
        except (BrokenProcessPool, custom.ScorerTimeout) as exc:  # a death; an alarm between two calls of the task
            if run.solo:
                died = "the reward worker process died while scoring this response"
                timed_out = custom.timeout_outcome(run.labels[chunk[0]], self.timeout_s)
                run.outcomes[chunk[0]] = ("error", died) if isinstance(exc, BrokenProcessPool) else timed_out
            else:
                run.suspects.extend(chunk)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            outcomes = [("error", f"{type(exc).__name__}: {exc}")] * len(chunk)
        for i, outcome in zip(chunk, outcomes):
            run.outcomes[i] = outcome

    def _restart_stuck(self, run: _PoolRun) -> None:
        """If a task has run past its hard deadline: score its call as a timeout (a task of several: re-run them one
        at a time, to find the one that is stuck), kill and forget the pool, and queue the other unfinished calls
        again (innocent bystanders)."""
        now = time.monotonic()
        expired = [
            fut
            for fut, (chunk, start) in run.inflight.items()
            if now - start >= self._hard_s(len(chunk)) and not fut.done()
        ]
        if not expired:
            return
        hard_s = self._hard_s(1)
        for fut in expired:
            chunk, _ = run.inflight.pop(fut)
            if len(chunk) > 1:
                run.suspects.extend(chunk)
                continue
            run.outcomes[chunk[0]] = (
                "timeout",
                f"reward function {run.labels[chunk[0]]} did not return within {hard_s:.1f} s "
                f"(reward.timeout_s={self.timeout_s:g} plus a grace period); its worker was killed",
            )
        logger.warning("reward worker stuck past the hard deadline (%.1f s a call); restarting the pool", hard_s)
        for fut, (chunk, _) in list(run.inflight.items()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                for i, outcome in zip(chunk, fut.result()):
                    run.outcomes[i] = outcome
            else:
                run.pending.extendleft(reversed(chunk))  # score them again in the new pool
        run.inflight.clear()
        self.kill()


def chunk_size(waiting: int, num_workers: int) -> int:
    """Calls per task: 1 while the workers keep up with the caller, more (up to ``MAX_CALLS_PER_TASK``) as calls
    wait, so that every worker still gets a share of what waits."""
    return max(1, min(MAX_CALLS_PER_TASK, waiting // (2 * num_workers)))


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
