"""Rule-based reward manager (verl ``DAPORewardManager`` semantics) with a process pool and per-call timeouts.

Flow for a batch of ``B`` right-padded responses ``[B, T]``: decode each valid prefix, route by ``data_source``,
score in worker processes, apply DAPO overlong shaping, put the final reward on the last valid token.

Routing: ``math_dapo``, ``math``, ``math_dapo_reasoning`` and names starting with ``aime`` use the built-in
:mod:`megatron_dapo.reward.math_dapo` scorer (as verl's ``default_compute_score``); every other data source uses
the configured custom function(s) (``reward.custom_function`` plus ``reward.extra_functions``, combined with
their weights), and without one the call fails with an error naming the data source and the config key.

Workers: a ``concurrent.futures.ProcessPoolExecutor`` (``forkserver`` start method where available, else
``spawn``; never ``fork``, since the caller holds threads) with ``reward.num_workers`` processes, created on first
use and kept. At most one scorer per worker is in flight, so each call's deadline is measured from its start. A
scorer that runs past ``reward.timeout_s`` is interrupted inside the worker (SIGALRM); one that does not return
within ``timeout_s + max(2, timeout_s)`` (the grace is a constructor argument; stuck in C code, signals blocked)
has the pool killed and recreated, and the other in-flight calls are resubmitted. If a worker dies, the calls
that were in flight are re-run one at a time, so only the culprit fails.

In-process scoring (``reward.num_workers = 0``) enforces ``reward.timeout_s`` with the same SIGALRM timer
(:func:`megatron_dapo.reward.custom.call_with_timeout`) when the manager is called from the main thread of the main
interpreter, restoring the previous SIGALRM handler, signal mask and timer afterwards. It cannot stop code that
never returns to the interpreter (a C extension that loops without checking for signals, or that blocks SIGALRM):
such a scorer hangs the caller, where the pool would kill its worker. Called from any other thread, no timer can
be armed: the call runs without a limit and the manager logs a warning once.

Results: a scorer's result must be a finite number or a dict with a finite ``score`` (rules in
:mod:`megatron_dapo.reward.custom`). A scorer that raises, times out or returns anything else (NaN, inf, None, a
bool, a string, ...) scores ``reward.error_score`` and is counted (``reward/num_errors``, ``reward/num_timeouts``);
the first ``reward.max_logged_errors`` failures of a call are logged with the data source, the function
(``path:name`` or ``math_dapo``) and the offending value or traceback. The scores a :class:`RewardResult` carries
are therefore always finite; the manager checks this before returning.

The worker processes import only :mod:`megatron_dapo.reward.custom` and :mod:`megatron_dapo.reward.math_dapo`
(no torch), plus the ``megatron_dapo`` package ``__init__``; the main module must be import-safe (guarded by
``if __name__ == "__main__"``), as for any spawn/forkserver pool.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dapo.config import ConfigError, RewardConfig, extra_function_spec, reward_value_problems
from megatron_dapo.reward import custom
from megatron_dapo.reward.overlong import overlong_penalty

logger = logging.getLogger(__name__)

__all__ = ["MATH_DAPO_SOURCES", "RewardInvariantError", "RewardManager", "RewardResult", "route_data_source"]

MATH_DAPO_SOURCES: tuple[str, ...] = ("math_dapo", "math", "math_dapo_reasoning")
_WARMUP_TIMEOUT_S = 120.0


class RewardInvariantError(RuntimeError):
    """The reward manager was about to return a non-finite reward: a bug in this module, not in a scorer."""


def route_data_source(data_source: str) -> str:
    """``"math_dapo"`` for the built-in math sources (and ``aime*``), else ``"custom"``."""
    if data_source in MATH_DAPO_SOURCES or str(data_source).startswith("aime"):
        return "math_dapo"
    return "custom"


@dataclass
class RewardResult:
    """Rewards of a batch of ``B`` responses of width ``T``.

    Attributes:
        token_level_scores: ``[B, T]`` float32, zero except the final reward on the last valid response token
            (position ``T - 1`` for an empty response, like verl's ``[-1]`` index).
        scores: ``[B]`` float32 final rewards (scorer score + overlong shaping).
        extra: per-response lists of length ``B``: ``score`` (the scorer's score, before shaping), ``acc`` (bool,
            or None when the scorer gave none and its score was not 0 or 1; False for a failed call),
            ``overlong_reward`` (0.0 when shaping is off), ``overlong`` (the response was truncated at
            ``max_response_length``: use it for ``reward.overlong_filter``), and the scorer's other dict keys
            (``pred`` for math_dapo); missing values are None.
        metrics: ``reward/num_errors``, ``reward/num_timeouts``, ``reward/num_overlong``, ``reward/score_mean``.
        response_lengths: ``[B]`` int64 valid lengths (last valid index + 1).
        overlong: ``[B]`` bool, same as ``extra["overlong"]``.
    """

    token_level_scores: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    response_lengths: torch.Tensor | None = None
    overlong: torch.Tensor | None = None


def merge_results(parts: Sequence[tuple[Sequence[int], RewardResult]], batch_size: int) -> RewardResult:
    """One ``RewardResult`` for a batch scored in shards: ``parts`` are ``(rows, result of those rows)`` covering
    every row of ``range(batch_size)`` once. Counts add up; ``reward/score_mean`` is over the whole batch."""
    first = parts[0][1]
    width = first.token_level_scores.shape[1]
    token_level = torch.zeros(batch_size, width, dtype=first.token_level_scores.dtype)
    scores = torch.zeros(batch_size, dtype=first.scores.dtype)
    lengths = torch.zeros(batch_size, dtype=torch.long)
    overlong = torch.zeros(batch_size, dtype=torch.bool)
    extra: dict[str, list] = {}
    metrics: dict[str, float] = {}
    seen = 0
    for rows, result in parts:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        seen += len(index)
        token_level[index] = result.token_level_scores
        scores[index] = result.scores
        if result.response_lengths is not None:
            lengths[index] = result.response_lengths
        if result.overlong is not None:
            overlong[index] = result.overlong
        for key, values in result.extra.items():
            column = extra.setdefault(key, [None] * batch_size)
            for row, value in zip(rows, values):
                column[row] = value
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    if seen != batch_size:
        raise ValueError(f"merge_results: the parts cover {seen} rows, the batch has {batch_size}")
    metrics["reward/score_mean"] = float(scores.mean().item()) if batch_size else 0.0
    return RewardResult(token_level, scores, extra, metrics, lengths, overlong)


def _custom_specs(config: RewardConfig) -> list[custom.RewardSpec]:
    specs: list[custom.RewardSpec] = []
    cf = config.custom_function
    if cf.path:
        specs.append((cf.path, cf.name, float(cf.weight)))
    for i, item in enumerate(config.extra_functions):
        spec, problems = extra_function_spec(item, f"reward.extra_functions[{i}]")
        if problems:
            raise ConfigError.of(problems)
        path, name, weight = spec
        specs.append((path, name, float(weight)))
    return specs


class RewardManager:
    """Score decoded responses, see the module docstring.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``; its ``eos_token`` string, if
            any, is stripped from the end of the decoded text (verl).
        config: the ``reward`` config section.
        max_response_length: ``data.max_response_length`` (for overlong shaping and the ``overlong`` flag).
        eos_token_id: id or ids of EOS; when given, a response of ``max_response_length`` tokens that ends with
            EOS does not count as truncated.
        hard_timeout_grace_s: how long past ``timeout_s`` to wait for a scorer that ignores the soft timeout
            before killing its worker; default ``max(2, timeout_s)``.

    Use as a context manager or call :meth:`close` to stop the worker processes.
    """

    def __init__(
        self,
        tokenizer: Any,
        config: RewardConfig,
        max_response_length: int,
        eos_token_id: int | Sequence[int] | None = None,
        hard_timeout_grace_s: float | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.max_response_length = int(max_response_length)
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] | None = None
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)
        ob = config.overlong_buffer
        if ob.enable and not 0 < ob.len <= self.max_response_length:
            raise ConfigError(
                f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
                f"{self.max_response_length}]"
            )
        _check_reward_config(config)
        self.custom_specs = _custom_specs(config)
        # load once in the caller's process: configuration errors surface here, not as per-sample errors
        self._custom_fn = custom.build_reward_function(self.custom_specs)
        self.num_workers = int(config.num_workers)
        self.timeout_s = float(config.timeout_s)
        self.hard_timeout_grace_s = (
            max(2.0, self.timeout_s) if hard_timeout_grace_s is None else float(hard_timeout_grace_s)
        )
        self._executor: ProcessPoolExecutor | None = None
        self._warned_timeout_unenforced = False
        self._warned_acc = False

    # ------------------------------------------------------------------ pool

    def _mp_context(self) -> multiprocessing.context.BaseContext:
        methods = multiprocessing.get_all_start_methods()
        return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._executor is not None and getattr(self._executor, "_broken", False):
            self._kill_pool()
        if self._executor is None:
            executor = ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=self._mp_context(),
                initializer=custom.init_worker,
                initargs=(self.custom_specs,),
            )
            # start every worker now, so that process start-up never counts against a scorer's deadline
            warmup = [executor.submit(custom.warmup, 0.05) for _ in range(self.num_workers)]
            done, not_done = wait(warmup, timeout=_WARMUP_TIMEOUT_S)
            if not_done or any(f.exception() is not None for f in done):
                self._executor = executor
                self._kill_pool()
                raise RuntimeError(f"reward worker processes did not start within {_WARMUP_TIMEOUT_S:.0f} s")
            self._executor = executor
        return self._executor

    def _kill_pool(self) -> None:
        executor, self._executor = self._executor, None
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
        """Stop the worker processes (a later call starts new ones)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_executor", None) is not None:
            with contextlib.suppress(Exception):  # best effort, possibly at interpreter shutdown
                self._kill_pool()

    # ------------------------------------------------------------------ scoring

    def _scorer_label(self, kind: str) -> str:
        if kind == "math_dapo" or self._custom_fn is None:
            return custom.MATH_DAPO_LABEL if kind == "math_dapo" else kind
        return self._custom_fn.describe()

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

    def _score_inline(self, kind: str, args: tuple) -> tuple[str, Any]:
        data_source, solution_str, ground_truth, extra_info = args
        return custom.score_response(
            kind,
            self._custom_fn,
            data_source,
            solution_str,
            ground_truth,
            extra_info,
            self.timeout_s,
            self._warn_timeout_unenforced,
        )

    def _score_all(self, kinds: list[str], args: list[tuple]) -> list[tuple[str, Any]]:
        """The outcome of every call: in the worker pool, or in this process with ``reward.num_workers = 0``."""
        if self.num_workers > 0 and args:
            return self._score_pool(kinds, args)
        return [self._score_inline(k, a) for k, a in zip(kinds, args, strict=True)]

    def _score_pool(self, kinds: list[str], args: list[tuple]) -> list[tuple[str, Any]]:
        """Score every item in the pool, at most one in flight per worker.

        A worker death (``BrokenProcessPool``) fails every call in flight; those items are re-run one at a time
        ("suspects"), so only the item that kills its worker when alone is scored as an error. A call still running
        at the hard deadline has the pool restarted (:meth:`_restart_stuck_pool`).
        """
        run = _PoolRun(outcomes=[None] * len(kinds), pending=deque(range(len(kinds))))
        hard_s = self.timeout_s + self.hard_timeout_grace_s if self.timeout_s > 0 else None
        while run.pending or run.suspects or run.inflight:
            executor = self._ensure_pool()
            if not run.inflight:
                run.solo = bool(run.suspects)
            try:
                self._submit(executor, run, kinds, args)
            except BrokenProcessPool:
                self._kill_pool()
                continue
            if not run.inflight:
                continue
            wait_s = None
            if hard_s is not None:
                wait_s = max(0.0, min(start for _, start in run.inflight.values()) + hard_s - time.monotonic())
            done, _ = wait(list(run.inflight), timeout=wait_s, return_when=FIRST_COMPLETED)
            for fut in done:
                i, _ = run.inflight.pop(fut)
                self._settle(fut, i, run, kinds)
            if hard_s is not None:
                self._restart_stuck_pool(run, kinds, hard_s)
        return [o if o is not None else ("error", "not scored") for o in run.outcomes]

    def _submit(self, executor: ProcessPoolExecutor, run: _PoolRun, kinds: list[str], args: list[tuple]) -> None:
        """Fill the free worker slots (a single slot while suspects run alone); on ``BrokenProcessPool`` the item
        goes back to its queue and the error propagates."""
        queue = run.suspects if run.solo else run.pending
        while len(run.inflight) < (1 if run.solo else self.num_workers) and queue:
            i = queue.popleft()
            try:
                fut = executor.submit(custom.run_scorer, kinds[i], *args[i], self.timeout_s)
            except BrokenProcessPool:
                queue.appendleft(i)
                raise
            run.inflight[fut] = (i, time.monotonic())

    def _settle(self, fut: Future, i: int, run: _PoolRun, kinds: list[str]) -> None:
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
                f"reward function {self._scorer_label(kinds[i])} exceeded reward.timeout_s={self.timeout_s:g} s",
            )
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            run.outcomes[i] = ("error", f"{type(exc).__name__}: {exc}")

    def _restart_stuck_pool(self, run: _PoolRun, kinds: list[str], hard_s: float) -> None:
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
                f"reward function {self._scorer_label(kinds[i])} did not return within {hard_s:.1f} s "
                f"(reward.timeout_s={self.timeout_s:g} plus a grace period); its worker was killed",
            )
        logger.warning("reward worker stuck past the hard deadline (%.1f s); restarting the pool", hard_s)
        for fut, (i, _) in list(run.inflight.items()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                run.outcomes[i] = fut.result()
            else:
                run.pending.appendleft(i)  # score it again in the new pool
        run.inflight.clear()
        self._kill_pool()

    def __call__(
        self,
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None] | None = None,
    ) -> RewardResult:
        """Score a batch.

        Args:
            responses: ``[B, T]`` token ids, right-padded.
            response_mask: ``[B, T]`` valid response tokens.
            data_sources, ground_truths: length ``B``.
            extra_infos: length ``B`` (dicts or None), passed to custom functions; None means all None.

        Returns:
            :class:`RewardResult`.
        """
        extra_infos = _check_batch(responses, response_mask, data_sources, ground_truths, extra_infos)
        batch, width = responses.shape
        kinds = self._route(data_sources)
        lengths = _valid_lengths(response_mask)
        ids = responses.detach().to("cpu")
        texts = self._decode(ids, lengths)
        args = [(data_sources[i], texts[i], ground_truths[i], extra_infos[i]) for i in range(batch)]
        outcomes = self._score_all(kinds, args)

        shaping = self._overlong_shaping(lengths)
        truncated = self._truncated(ids, lengths)
        rows, num_errors, num_timeouts = self._rows(outcomes, kinds, data_sources)
        final = (torch.tensor([r["score"] for r in rows], dtype=torch.float64) + shaping).to(torch.float32)
        token_level_scores = _on_last_token(final, lengths, width)
        _check_finite(final, token_level_scores, rows, shaping)
        metrics = {
            "reward/num_errors": float(num_errors),
            "reward/num_timeouts": float(num_timeouts),
            "reward/num_overlong": float(truncated.sum().item()),
            "reward/score_mean": float(final.mean().item()) if batch else 0.0,
        }
        return RewardResult(
            token_level_scores=token_level_scores,
            scores=final,
            extra=_extra_columns(rows, shaping, truncated),
            metrics=metrics,
            response_lengths=lengths.to(torch.long),
            overlong=truncated,
        )

    # ------------------------------------------------------------------ parts of __call__

    def _route(self, data_sources: Sequence[str]) -> list[str]:
        """The scorer kind of every response (:func:`route_data_source`); a ``ConfigError`` naming the data sources
        if some need a custom function and none is configured."""
        kinds = [route_data_source(ds) for ds in data_sources]
        if "custom" in kinds and self._custom_fn is None:
            missing = sorted({str(ds) for ds, k in zip(data_sources, kinds, strict=True) if k == "custom"})
            raise ConfigError(
                f"no reward function for data_source {', '.join(repr(m) for m in missing)}: the built-in scorer "
                f"handles {', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and "
                "reward.custom_function.name) to a Python file defining "
                "compute_score(data_source, solution_str, ground_truth, extra_info)"
            )
        return kinds

    def _decode(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """The text of each response's valid prefix, special tokens skipped and a trailing EOS string removed."""
        eos_text = getattr(self.tokenizer, "eos_token", None)
        texts = []
        for i in range(ids.shape[0]):
            text = self.tokenizer.decode(ids[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
            if isinstance(eos_text, str) and eos_text and text.endswith(eos_text):
                text = text[: -len(eos_text)]
            texts.append(text)
        return texts

    def _overlong_shaping(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` float64 DAPO overlong penalty (zeros when ``reward.overlong_buffer`` is off)."""
        ob = self.config.overlong_buffer
        if not ob.enable:
            return torch.zeros(len(lengths), dtype=torch.float64)
        return overlong_penalty(lengths, self.max_response_length, ob.len, ob.penalty_factor, torch.float64)

    def _truncated(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the response has ``max_response_length`` tokens and (when EOS ids are known) does not end
        with EOS."""
        truncated = lengths >= self.max_response_length
        if self.eos_token_ids is not None:
            for i in range(len(truncated)):
                if truncated[i] and int(ids[i, int(lengths[i]) - 1]) in self.eos_token_ids:
                    truncated[i] = False
        return truncated

    def _rows(
        self, outcomes: list[tuple[str, Any]], kinds: list[str], data_sources: Sequence[str]
    ) -> tuple[list[dict[str, Any]], int, int]:
        """``(rows, num_errors, num_timeouts)``: one row per outcome, the scorer's row or ``reward.error_score``
        with ``acc`` False for a failed call; the first ``reward.max_logged_errors`` failures are logged."""
        num_errors = num_timeouts = logged = 0
        rows: list[dict[str, Any]] = []
        for i, (status, payload) in enumerate(outcomes):
            if status == "ok":
                row, note = payload
                _check_row(row, i)
                if note is not None and not self._warned_acc:
                    self._warned_acc = True
                    logger.warning("%s (data_source=%r; logged once)", note, data_sources[i])
                rows.append(row)
                continue
            if status == "timeout":
                num_timeouts += 1
            else:
                num_errors += 1
            if logged < self.config.max_logged_errors:
                logged += 1
                logger.warning(
                    "reward %s for response %d (data_source=%r, function %s); scoring it %s:\n%s",
                    "timeout" if status == "timeout" else "error",
                    i,
                    data_sources[i],
                    self._scorer_label(kinds[i]),
                    self.config.error_score,
                    payload,
                )
            rows.append({"score": float(self.config.error_score), "acc": False})
        if logged < num_errors + num_timeouts:
            logger.warning(
                "reward: %d more failures not logged (reward.max_logged_errors=%d)",
                num_errors + num_timeouts - logged,
                self.config.max_logged_errors,
            )
        return rows, num_errors, num_timeouts


@dataclass
class _PoolRun:
    """Bookkeeping of one :meth:`RewardManager._score_pool` call (indices into its items)."""

    outcomes: list[tuple[str, Any] | None]
    pending: deque[int]  # not yet submitted
    suspects: deque[int] = field(default_factory=deque)  # in flight when a worker died: re-run one at a time
    inflight: dict[Future, tuple[int, float]] = field(default_factory=dict)  # future -> (index, start time)
    solo: bool = False  # suspects are running, one at a time


def _check_batch(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    data_sources: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None,
) -> Sequence[dict | None]:
    """Check the shapes and lengths of a batch; returns ``extra_infos`` (all None when not given)."""
    if responses.dim() != 2 or responses.shape != response_mask.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} must both be [B, T]"
        )
    batch = responses.shape[0]
    if extra_infos is None:
        extra_infos = [None] * batch
    for name, seq in (
        ("data_sources", data_sources),
        ("ground_truths", ground_truths),
        ("extra_infos", extra_infos),
    ):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries, responses has {batch} rows")
    return extra_infos


def _valid_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` valid length of each row of a ``[B, T]`` mask: its last valid index + 1 (0 for none)."""
    mask = response_mask.detach().to("cpu").bool()
    batch, width = mask.shape
    if not width:
        return torch.zeros(batch, dtype=torch.long)
    positions = torch.arange(1, width + 1).expand(batch, width)
    return torch.where(mask, positions, torch.zeros_like(positions)).amax(dim=-1)


def _on_last_token(final: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` float32 zeros with ``final[i]`` on row ``i``'s last valid token (``T - 1`` for an empty one)."""
    batch = len(final)
    token_level_scores = torch.zeros(batch, width, dtype=torch.float32)
    if width:
        last = torch.where(lengths > 0, lengths - 1, torch.full_like(lengths, width - 1))
        token_level_scores[torch.arange(batch), last] = final
    return token_level_scores


def _check_finite(
    final: torch.Tensor, token_level_scores: torch.Tensor, rows: list[dict[str, Any]], shaping: torch.Tensor
) -> None:
    """Raise :class:`RewardInvariantError` if a final reward is not finite (a bug: scorer results are checked)."""
    if bool(torch.isfinite(final).all()) and bool(torch.isfinite(token_level_scores).all()):
        return
    bad = torch.nonzero(~torch.isfinite(final)).flatten().tolist()
    raise RewardInvariantError(
        f"internal error in megatron_dapo/reward/manager.py: non-finite final rewards for responses {bad} "
        f"(scores {[rows[i]['score'] for i in bad]}, overlong shaping {[float(shaping[i]) for i in bad]}); "
        "every scorer result is checked before this point, so this is a bug here"
    )


def _extra_columns(rows: list[dict[str, Any]], shaping: torch.Tensor, truncated: torch.Tensor) -> dict[str, list]:
    """``RewardResult.extra``: ``score``, ``acc``, the scorers' other keys (first seen first, None where missing),
    ``overlong_reward`` and ``overlong``."""
    keys: list[str] = ["score", "acc"]
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    extra: dict[str, list] = {k: [row.get(k) for row in rows] for k in keys}
    extra["overlong_reward"] = shaping.tolist()
    extra["overlong"] = truncated.tolist()
    return extra


def _check_reward_config(config: RewardConfig) -> None:
    """The config loader's checks of the ``reward`` section, again: a ``RewardConfig`` can be built directly, and a
    bad value here would let a NaN out of the manager or a scorer run forever."""
    problems = reward_value_problems(config)
    if problems:
        raise ConfigError.of(problems)


def _check_row(row: Any, index: int) -> None:
    """The invariant of every "ok" scorer outcome (see :func:`megatron_dapo.reward.custom.normalise_result`)."""
    score = row.get("score") if isinstance(row, dict) else None
    if type(score) is not float or not math.isfinite(score):
        raise RewardInvariantError(
            f"internal error in megatron_dapo/reward/manager.py: response {index} was scored ok with a row that is "
            f"not a dict with a finite float 'score': {custom.short_repr(row)}"
        )
