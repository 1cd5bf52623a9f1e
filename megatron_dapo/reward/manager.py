"""Rule-based reward manager (verl ``DAPORewardManager`` semantics) with a process pool and per-call timeouts.

Flow for a batch of ``B`` right-padded responses ``[B, T]``: decode each valid prefix, route by ``data_source``,
score in worker processes, apply DAPO overlong shaping, put the final reward on the last valid token. The same flow
one response at a time, as the engine ends them (``reward.overlap_generation``): :meth:`RewardManager.stream`, then
:meth:`RewardManager.result` over the finished batch.

The manager composes two modules:

* :mod:`megatron_dapo.reward.scoring`, the rules (pure functions). Routing: ``math_dapo``, ``math``,
  ``math_dapo_reasoning`` and names starting with ``aime`` use the built-in :mod:`megatron_dapo.reward.math_dapo`
  scorer (as verl's ``default_compute_score``); every other data source uses the configured custom function(s)
  (``reward.custom_function`` plus ``reward.extra_functions``, combined with their weights), and without one the
  call fails with a ``ConfigError`` naming the data source and the config key. A failed call scores
  ``reward.error_score`` with ``acc`` False; overlong shaping and the truncation flag; the final rewards, checked
  finite before they are returned (:class:`RewardInvariantError` otherwise: a bug, since every scorer result is
  checked).
* :mod:`megatron_dapo.reward.workers`, the supervisor: where scorers run (``reward.num_workers`` worker processes,
  or this process with ``0``), their time limits (``reward.timeout_s``: SIGALRM, and in the pool a hard deadline
  after which a stuck worker is killed and the pool recreated), a scorer that raises, hangs or takes its worker
  down (only that response fails), and the failure counts and logs (``reward/num_errors``,
  ``reward/num_timeouts``; the first ``reward.max_logged_errors`` failures of a call are logged with the data
  source, the function, ``path:name`` or ``math_dapo``, and the offending value or traceback).

Results: a scorer's result must be a finite number or a dict with a finite ``score`` (rules in
:mod:`megatron_dapo.reward.custom`); anything else (NaN, inf, None, a bool, a string, ...) is a failed call. The
scores a :class:`RewardResult` carries are therefore always finite.

The ``reward`` section is checked by the command's gate (``config/plan.resolve`` for ``train``, the config rules
for ``eval``: ``rules.reward_value_problems`` and the overlong buffer against the response budget), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_dapo.config import RewardConfig
from megatron_dapo.reward import custom
from megatron_dapo.reward.scoring import (
    MATH_DAPO_SOURCES,
    RewardInvariantError,
    RewardResult,
    build_result,
    check_batch,
    custom_specs,
    decode_response,
    merge_results,
    outcome_row,
    overlong_shaping,
    route,
    route_data_source,
    scorer_label,
    truncated_rows,
    valid_lengths,
)
from megatron_dapo.reward.workers import FailureLog, InlineScorer, ScorerPool

__all__ = [
    "MATH_DAPO_SOURCES",
    "RewardInvariantError",
    "RewardManager",
    "RewardResult",
    "RewardStream",
    "merge_results",
    "route_data_source",
]


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

    Raises:
        ConfigError: the ``reward`` section breaks a config rule (all its problems at once).
        FileNotFoundError, ImportError, AttributeError, TypeError: a custom reward function cannot be loaded
            (:func:`megatron_dapo.reward.custom.load_reward_function`).

    Attributes:
        pool: the :class:`~megatron_dapo.reward.workers.ScorerPool` (None with ``reward.num_workers = 0``).

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
        self.custom_specs = custom_specs(config)
        # load once in the caller's process: configuration errors surface here, not as per-sample errors
        self._custom_fn = custom.build_reward_function(self.custom_specs)
        self.num_workers = int(config.num_workers)
        self.timeout_s = float(config.timeout_s)
        self.hard_timeout_grace_s = (
            max(2.0, self.timeout_s) if hard_timeout_grace_s is None else float(hard_timeout_grace_s)
        )
        self._inline = InlineScorer(self._custom_fn, self.timeout_s)
        self.pool = (
            ScorerPool(self.num_workers, self.custom_specs, self.timeout_s, self.hard_timeout_grace_s)
            if self.num_workers > 0
            else None
        )
        self._failures = FailureLog(config.max_logged_errors, config.error_score)

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

        Raises:
            ValueError: the shapes or lengths of the inputs disagree.
            ConfigError: a data source needs a custom reward function and none is configured.
        """
        extra_infos = check_batch(responses, response_mask, data_sources, ground_truths, extra_infos)
        lengths = valid_lengths(response_mask)
        ids = responses.detach().to("cpu")
        stream = self.stream()
        for row, length, source, truth, extra in zip(
            ids.tolist(), lengths.tolist(), data_sources, ground_truths, extra_infos
        ):
            stream.add(row[: int(length)], source, truth, extra)
        rows, failures = stream.finish()
        return self.result(rows, ids, response_mask, failures)

    def stream(self) -> RewardStream:
        """A :class:`RewardStream`: responses scored one by one as they arrive (while the engine generates)."""
        return RewardStream(self)

    def result(
        self,
        rows: list[dict[str, Any]],
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        failures: tuple[int, int],
    ) -> RewardResult:
        """The batch's :class:`RewardResult` from its scored ``rows`` (one per response, in order: what
        :meth:`RewardStream.finish` returns): overlong shaping, the truncation flag, the final reward on the last
        valid token. ``failures`` is ``(num_errors, num_timeouts)``."""
        if len(rows) != responses.shape[0]:
            raise ValueError(f"{len(rows)} scored rows for a batch of {responses.shape[0]} responses")
        lengths = valid_lengths(response_mask)
        ids = responses.detach().to("cpu")
        return build_result(
            rows,
            lengths,
            overlong_shaping(lengths, self.max_response_length, self.config.overlong_buffer),
            truncated_rows(ids, lengths, self.max_response_length, self.eos_token_ids),
            ids.shape[1],
            failures,
        )


class RewardStream:
    """Responses scored as they arrive: ``add`` decodes a response and queues it for the worker processes (a thread
    of the pool's session keeps them busy while the caller generates), ``finish`` waits for the rest and returns the
    rows in the order they were added, with the failures counted and logged as a batch's. With
    ``reward.num_workers = 0`` the calls run in ``finish``, in this process.

    ``add`` raises ``ConfigError`` for a data source no scorer takes (as :meth:`RewardManager.__call__` does)."""

    def __init__(self, manager: RewardManager) -> None:
        self.manager = manager
        self.session = manager.pool.session() if manager.pool is not None else None
        self.kinds: list[str] = []
        self.labels: list[str] = []
        self.sources: list[str] = []
        self.calls: list[tuple] = []  # inline scoring's calls, run in finish()

    def add(self, token_ids: Sequence[int], data_source: str, ground_truth: Any, extra_info: dict | None) -> None:
        """Score one response: its valid tokens (no padding), the prompt's data source, ground truth and extra
        info."""
        m = self.manager
        kind = route([data_source], m._custom_fn is not None)[0]
        label = scorer_label(kind, m._custom_fn)
        text = decode_response(m.tokenizer, token_ids)
        call = (data_source, text, ground_truth, extra_info)
        self.kinds.append(kind)
        self.labels.append(label)
        self.sources.append(data_source)
        if self.session is not None:
            self.session.add(kind, call, label)
        else:
            self.calls.append(call)

    def settled(self) -> int:
        """How many responses have their outcome already (inline scoring: none before ``finish``)."""
        return self.session.settled() if self.session is not None else 0

    def finish(self) -> tuple[list[dict[str, Any]], tuple[int, int]]:
        """Every added response's row (:func:`~megatron_dapo.reward.scoring.outcome_row`), in order, and
        ``(num_errors, num_timeouts)``; the first failures are logged."""
        m = self.manager
        outcomes = self.session.finish() if self.session is not None else m._inline.run(self.kinds, self.calls)
        failures = m._failures.report(outcomes, self.sources, self.labels)
        rows = [outcome_row(outcome, i, m.config.error_score) for i, outcome in enumerate(outcomes)]
        return rows, failures
