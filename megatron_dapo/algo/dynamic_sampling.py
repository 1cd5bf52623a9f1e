"""DAPO dynamic sampling: drop prompt groups whose responses all got the same reward, accumulate generation
batches until a training batch is full (verl ``recipe/dapo/dapo_ray_trainer.py`` semantics).

Pure Python/PyTorch; no process groups (every rank holding the same batch gets the same answer).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from megatron_dapo.algo.advantages import GroupIds, group_index

# A batch of rows: a dict of tensors / arrays with a leading [B] dimension or lists of length B, or an object with
# ``__len__``, ``select(rows)`` and a classmethod ``concat(parts)`` (``megatron_dapo.batch.TrainBatch``).
Batch = Any

__all__ = [
    "DynamicSamplingAccumulator",
    "TrainedBatchWindow",
    "concat_batches",
    "filter_groups",
    "gen_batch_budget",
    "select_rows",
]


def _to_float64(values: torch.Tensor | np.ndarray | Sequence[Any]) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).reshape(-1)
    return torch.as_tensor(np.asarray(values, dtype=np.float64).reshape(-1))


def filter_groups(metric_values: torch.Tensor | np.ndarray | Sequence[float], group_ids: GroupIds) -> torch.Tensor:
    """Which responses to keep: those whose group has a non-zero metric spread, or is a group of one.

    Args:
        metric_values: ``[B]`` per-response metric (``acc``, ``score``, ``seq_reward``, ``seq_final_reward``).
        group_ids: ``[B]`` prompt ids (any hashables).

    Returns:
        ``keep[B]`` bool tensor (on the CPU). A group is kept iff its metric values are not all equal (verl:
        ``np.std > 0``) **or it has a single response** (verl keeps groups of one: ``std > 0 or len(vals) == 1``).
        A group with a NaN metric is dropped unless it is a group of one (verl: ``nan > 0`` is False).

    "Not all equal" is tested exactly (``max > min``). verl's ``np.std`` can be a rounding-level positive number
    for identical values that are not exactly representable (e.g. ``np.std([0.1] * 3) = 1.4e-17``), in which case
    verl keeps a constant group; we drop it, which is what the filter is for. For the usual metrics (``acc``,
    +-1 scores) the two agree.
    """
    values = _to_float64(metric_values)
    if values.shape[0] != len(group_ids):
        raise ValueError(f"metric_values has {values.shape[0]} entries, group_ids has {len(group_ids)}")
    if values.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    index, num_groups = group_index(group_ids)
    counts = torch.bincount(index, minlength=num_groups)
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amax")
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, index, values, "amin")
    has_nan = torch.zeros(num_groups, dtype=torch.bool).index_put_((index,), values.isnan(), accumulate=True)
    keep_group = ((hi > lo) & ~has_nan) | (counts == 1)
    return keep_group[index]


def _length(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, (torch.Tensor, np.ndarray)) else len(value)


def select_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """Rows ``rows`` (in that order) of every entry of ``batch``."""
    if not isinstance(batch, dict):
        return batch.select(list(rows))
    out: Batch = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value[torch.as_tensor(list(rows), dtype=torch.long, device=value.device)]
        elif isinstance(value, np.ndarray):
            out[key] = value[np.asarray(rows, dtype=np.int64)]
        else:
            out[key] = [value[i] for i in rows]
    return out


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches with the same keys along the first dimension (tensors: ``torch.cat``; arrays:
    ``np.concatenate``; lists: list concatenation). Tensors must agree on trailing dims (pad before adding)."""
    if not batches:
        return {}
    if not isinstance(batches[0], dict):
        return type(batches[0]).concat(batches)
    keys = list(batches[0])
    out: Batch = {}
    for key in keys:
        parts = [b[key] for b in batches]
        first = parts[0]
        if isinstance(first, torch.Tensor):
            out[key] = torch.cat(parts, dim=0)
        elif isinstance(first, np.ndarray):
            out[key] = np.concatenate(parts, axis=0)
        else:
            out[key] = [x for p in parts for x in p]
    return out


class DynamicSamplingAccumulator:
    """Collects kept prompt groups over generation batches until ``train_batch_size`` prompts are available.

    Usage per training step::

        acc = DynamicSamplingAccumulator(train_batch_size, n)
        while not acc.is_full():
            batch = generate_and_score(...)
            acc.add(batch, group_ids, metric_values)
            acc.check_budget(cfg.algorithm.filter_groups.max_num_gen_batches)   # raises if over budget
        train_batch = acc.take()    # exactly train_batch_size * n trajectories

    Group ids are scoped to one ``add`` call (ids may repeat across generation batches). Groups are kept whole and
    in arrival order (order of first appearance); the trajectories of a group keep their relative order.
    ``take`` returns the first ``train_batch_size`` kept groups and discards the surplus (verl trims to
    ``train_batch_size * n`` trajectories and drops the rest), then resets the counters for the next step.

    With ``enable=False`` every group is kept (verl's behaviour without ``filter_groups``).
    """

    def __init__(self, train_batch_size: int, n: int, enable: bool = True) -> None:
        if train_batch_size <= 0 or n <= 0:
            raise ValueError(f"train_batch_size ({train_batch_size}) and n ({n}) must be positive")
        self.train_batch_size = train_batch_size
        self.n = n
        self.enable = enable
        self._reset()

    def _reset(self) -> None:
        self._groups: list[tuple[int, list[int]]] = []  # (part index, rows) per kept group, arrival order
        self._dropped: list[tuple[int, list[int]]] = []  # the groups the filter dropped, for take_partial's filler
        self._parts: list[Batch] = []
        self._part_group_ids: list[list[Hashable]] = []
        self.num_gen_batches = 0
        self.num_prompts_generated = 0
        self.num_trajectories_generated = 0

    # ------------------------------------------------------------------ state

    @property
    def num_prompts_kept(self) -> int:
        """Kept prompt groups so far (may exceed ``train_batch_size`` before ``take``)."""
        return len(self._groups)

    @property
    def kept_ratio(self) -> float:
        """Kept prompts / generated prompts since the last ``take`` (0.0 before anything was generated)."""
        return self.num_prompts_kept / self.num_prompts_generated if self.num_prompts_generated else 0.0

    def is_full(self) -> bool:
        return self.num_prompts_kept >= self.train_batch_size

    def metrics(self) -> dict[str, float]:
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/num_prompts_kept": float(self.num_prompts_kept),
            "train/num_prompts_generated": float(self.num_prompts_generated),
            "train/kept_prompt_ratio": self.kept_ratio,
        }

    # ------------------------------------------------------------------ operations

    def add(
        self,
        batch: Batch,
        group_ids: GroupIds,
        metric_values: torch.Tensor | np.ndarray | Sequence[float] | None = None,
    ) -> None:
        """Add one generation batch (``B`` trajectories; ``B`` may be 0) and keep its informative groups.

        Args:
            batch: ``B`` rows (see ``Batch``).
            group_ids: ``[B]`` prompt ids.
            metric_values: ``[B]`` filter metric; ignored (may be None) when filtering is disabled.
        """
        size = len(group_ids)
        lengths = {k: _length(v) for k, v in batch.items()} if isinstance(batch, dict) else {"batch": len(batch)}
        for key, length in lengths.items():
            if length != size:
                raise ValueError(f"batch[{key!r}] has {length} rows, group_ids has {size}")
        self.num_gen_batches += 1
        self.num_trajectories_generated += size
        part = len(self._parts)  # == generation batch index since the last take()
        self._parts.append(batch)
        self._part_group_ids.append(list(group_ids.tolist() if hasattr(group_ids, "tolist") else group_ids))
        if size == 0:
            return
        index, num_groups = group_index(group_ids)
        self.num_prompts_generated += num_groups
        if self.enable:
            if metric_values is None:
                raise ValueError("metric_values are required when dynamic sampling (filter_groups) is enabled")
            keep = filter_groups(metric_values, group_ids).tolist()
        else:
            keep = [True] * size
        rows_of: list[list[int]] = [[] for _ in range(num_groups)]
        for row, g in enumerate(index.tolist()):
            rows_of[g].append(row)
        for rows in rows_of:
            (self._groups if keep[rows[0]] else self._dropped).append((part, rows))

    def is_exhausted(self, max_num_gen_batches: int) -> bool:
        """The batch is not full and ``max_num_gen_batches`` (> 0) generation batches were generated."""
        return not self.is_full() and 0 < max_num_gen_batches <= self.num_gen_batches

    def check_budget(self, max_num_gen_batches: int) -> None:
        """Raise ``RuntimeError`` if the batch is exhausted (see ``is_exhausted``; ``<= 0`` never raises)."""
        if not self.is_exhausted(max_num_gen_batches):
            return
        raise RuntimeError(
            f"dynamic sampling kept {self.num_prompts_kept} of {self.num_prompts_generated} generated prompts "
            f"({self.num_trajectories_generated} trajectories) after {self.num_gen_batches} generation batches, "
            f"but a training step needs {self.train_batch_size} prompts with a non-zero reward spread "
            f"(algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches}). Raise "
            "algorithm.filter_groups.max_num_gen_batches or data.gen_batch_size, set "
            "algorithm.filter_groups.on_exhausted=train (train on what was kept) or stop, or check the "
            "rewards: most groups got identical rewards (data too easy/too hard, or a broken reward function)."
        )

    def take(self, return_group_ids: bool = False) -> Batch | tuple[Batch, list[Hashable]]:
        """The training batch: the first ``train_batch_size`` kept groups, concatenated (``train_batch_size * n``
        trajectories when every group has ``n`` responses). Resets the accumulator.

        With ``return_group_ids`` also returns the ``[train_batch_size * n]`` group ids, made unique across
        generation batches as ``(gen_batch_index, original_id)`` tuples.
        """
        if not self.is_full():
            raise RuntimeError(
                f"take() before the batch is full: {self.num_prompts_kept} of {self.train_batch_size} prompts kept"
            )
        out, ids = self._assemble(self._groups[: self.train_batch_size])
        self._reset()
        return (out, ids) if return_group_ids else out

    def take_partial(self) -> tuple[Batch, list[Hashable], torch.Tensor]:
        """An exhausted step's batch: every kept group, then dropped (all-equal) groups as filler up to
        ``train_batch_size`` groups, so that the batch has its configured size. Resets the accumulator.

        Returns ``(batch, group_ids, filler)`` with ``filler[B]`` True on the filler rows. A filler group has equal
        rewards, so its group-relative advantage is zero; the caller leaves it out of the loss (and its
        normalisers) through the loss mask. Dropped groups are reused in turn when there are fewer than needed.
        """
        if self.num_prompts_generated == 0:
            raise RuntimeError("take_partial() before anything was generated")
        kept = self._groups[: self.train_batch_size]
        missing = self.train_batch_size - len(kept)
        if missing and not self._dropped:  # every group kept and still too few: nothing to fill with
            raise RuntimeError(
                f"dynamic sampling kept all {len(kept)} groups it generated, fewer than the {self.train_batch_size} a "
                "batch needs, and dropped none to fill it with (algorithm.filter_groups.max_num_gen_batches x "
                "data.gen_batch_size < data.train_batch_size?)"
            )
        filler = [self._dropped[i % len(self._dropped)] for i in range(missing)] if missing else []
        out, ids = self._assemble(kept + filler)
        filler_rows = sum(len(rows) for _, rows in filler)
        is_filler = torch.zeros(len(ids), dtype=torch.bool)
        # _assemble keeps the order of `chosen`, so the filler rows are the last ones.
        if filler_rows:
            is_filler[-filler_rows:] = True
        self._reset()
        return out, ids, is_filler

    def _assemble(self, chosen: list[tuple[int, list[int]]]) -> tuple[Batch, list[Hashable]]:
        pieces: list[Batch] = []
        ids: list[Hashable] = []
        # consecutive groups from the same generation batch are selected in one go
        run_part, run_rows = chosen[0][0], list(chosen[0][1])
        for part, rows in chosen[1:] + [(-1, [])]:
            if part == run_part:
                run_rows.extend(rows)
                continue
            pieces.append(select_rows(self._parts[run_part], run_rows))
            ids.extend((run_part, self._part_group_ids[run_part][r]) for r in run_rows)
            run_part, run_rows = part, list(rows)
        return concat_batches(pieces), ids


# ----- per trained batch, where groups end one by one (the async rollout ranks)
#
# Dynamic sampling counted per trained batch where groups end one by one and the kept ones are handed on at once: the
# async job's rollout ranks (``training/rollout_worker.py``) queue each kept group as it is scored and the training
# ranks cut the queue into batches of ``train_batch_size`` groups.
#
# A *window* is what one such batch costs: the groups scored since the last cut, counted in generation batches of
# ``gen_batch_size`` groups in the order they ended (a group ends when all its responses have; the rollout ranks start
# groups as the staleness gate allows, not a generation batch at a time, so their rounds are no measure). The window's
# generation batches go into a ``DynamicSamplingAccumulator``, so ``max_num_gen_batches`` binds by its rule
# (``is_exhausted``), an exhausted window is filled with the dropped groups a synchronous ``on_exhausted=train`` step
# trains on (``take_partial``), and ``error`` raises ``check_budget``'s message. Unlike a synchronous step nothing
# generated is dropped: the window closes at the group that fills the batch, and the next group opens the next one.
#
# (Pure Python, as above.)


def gen_batch_budget(max_num_gen_batches: int, num_prompts: int, gen_batch_size: int) -> int:
    """The generation batches a trained batch may cost: ``algorithm.filter_groups.max_num_gen_batches``, where 0 is
    one pass over the training prompts (a solved task would otherwise generate for ever)."""
    return max_num_gen_batches or -(-num_prompts // gen_batch_size)


class TrainedBatchWindow:
    """The generation batches of one trained batch (module docstring), and run totals for the consumer's metrics.

    ``max_num_gen_batches`` must be positive here: the caller turns the config's 0 into its one pass over the prompts.
    """

    def __init__(self, train_batch_size: int, n: int, gen_batch_size: int, enable: bool, max_num_gen_batches: int):
        if max_num_gen_batches <= 0:
            raise ValueError(f"max_num_gen_batches ({max_num_gen_batches}) must be positive")
        self.train_batch_size, self.n, self.enable = train_batch_size, n, enable
        self.gen_batch_size, self.budget = gen_batch_size, max_num_gen_batches
        # Over the run: generation batches begun, groups scored, groups kept (differences make a batch's metrics).
        self.totals = {"gen_batches": 0, "generated": 0, "kept": 0}
        self._open()

    def _open(self) -> None:
        self.acc = DynamicSamplingAccumulator(self.train_batch_size, self.n, enable=self.enable)
        self._pending: list[tuple[Batch, Hashable, torch.Tensor]] = []  # the generation batch being formed
        self._pending_kept = 0

    @property
    def num_prompts_kept(self) -> int:
        return self.acc.num_prompts_kept + self._pending_kept

    def add(self, rows: Batch, group_id: Hashable, metric_values: Optional[torch.Tensor] = None) -> bool:
        """One scored group (its ``n`` rows and their filter metric, ignored when filtering is off): whether to hand
        it on (kept). The group that fills the batch closes the window."""
        keep = not self.enable or bool(filter_groups(metric_values, [group_id] * self.n)[0])
        self.totals["gen_batches"] += not self._pending
        self.totals["generated"] += 1
        self.totals["kept"] += keep
        self._pending.append((rows, group_id, metric_values))
        self._pending_kept += keep
        if self.num_prompts_kept >= self.train_batch_size:
            self._open()
        elif len(self._pending) == self.gen_batch_size:
            parts, ids, metrics = zip(*self._pending, strict=True)
            rows_ids = [gid for gid in ids for _ in range(self.n)]
            metric = torch.cat([m.reshape(-1) for m in metrics]) if self.enable else None
            self.acc.add(concat_batches(parts), rows_ids, metric)
            self._pending, self._pending_kept = [], 0
        return keep

    @property
    def exhausted(self) -> bool:
        return self.acc.is_exhausted(self.budget)

    def take_filler(self) -> Optional[tuple[Batch, list[Hashable]]]:
        """An exhausted window's filler: the dropped groups that fill the batch up (``take_partial``'s), their rows
        and a group id per row; the next window opens. None, the window left as it is, when it dropped no group
        (every group kept and still too few: ``max_num_gen_batches x gen_batch_size < train_batch_size``)."""
        self._check_exhausted()
        if self.acc.num_prompts_kept == self.acc.num_prompts_generated:
            return None
        batch, ids, filler = self.acc.take_partial()
        rows = filler.nonzero().flatten().tolist()
        self._open()
        return select_rows(batch, rows), [ids[r][1] for r in rows]  # ids are (generation batch, group id)

    def close(self) -> str:
        """An exhausted window's message (``check_budget``'s: what ``on_exhausted=error`` raises). The next window
        opens."""
        self._check_exhausted()
        message = ""
        try:
            self.acc.check_budget(self.budget)
        except RuntimeError as exc:
            message = str(exc)
        self._open()
        return message

    def _check_exhausted(self) -> None:
        if not self.exhausted:
            raise RuntimeError("the window is not exhausted")
