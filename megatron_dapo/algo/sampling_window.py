"""Dynamic sampling counted per trained batch where groups end one by one and the kept ones are handed on at once: the
async job's rollout ranks (``training/rollout_worker.py``) queue each kept group as it is scored and the training
ranks cut the queue into batches of ``train_batch_size`` groups.

A *window* is what one such batch costs: the groups scored since the last cut, counted in generation batches of
``gen_batch_size`` groups in the order they ended (a group ends when all its responses have; the rollout ranks start
groups as the staleness gate allows, not a generation batch at a time, so their rounds are no measure). The window's
generation batches go into a ``DynamicSamplingAccumulator``, so ``max_num_gen_batches`` binds by its rule
(``is_exhausted``), an exhausted window is filled with the dropped groups a synchronous ``on_exhausted=train`` step
trains on (``take_partial``), and ``error`` raises ``check_budget``'s message. Unlike a synchronous step nothing
generated is dropped: the window closes at the group that fills the batch, and the next group opens the next one.

Pure Python; no process group.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch

from megatron_dapo.algo.dynamic_sampling import (
    Batch,
    DynamicSamplingAccumulator,
    concat_batches,
    filter_groups,
    select_rows,
)

__all__ = ["TrainedBatchWindow", "gen_batch_budget"]


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
