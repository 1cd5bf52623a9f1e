"""Seeded, resumable batching of prompt indices across epochs."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_dapo.data.rows import DataError

# Keys of ``state_dict`` that describe the sampler's setup; a resumed run must match them, otherwise "the next batch"
# would not be the one the interrupted run would have drawn.
_SETUP_KEYS = ("dataset_len", "batch_size", "shuffle", "seed", "drop_last")


class PromptSampler:
    """Batches of dataset indices, epoch after epoch.

    Epoch ``e`` visits the indices in the order ``numpy.random.default_rng(seed + e).permutation(dataset_len)``
    (or ``0..n-1`` without shuffle), cut into ``batch_size`` pieces; with ``drop_last`` the incomplete tail is
    skipped. ``epoch`` and ``position`` (batches already taken in that epoch) are advanced eagerly: right after the
    last batch of epoch 0 the state is epoch 1, position 0, so ``sampler.epoch`` tells a trainer how many epochs are
    complete. ``state_dict`` / ``load_state_dict`` make a resumed run draw exactly the batch an uninterrupted run
    would have drawn next.
    """

    def __init__(
        self, dataset_len: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if dataset_len <= 0:
            raise DataError(f"PromptSampler: dataset_len must be positive, got {dataset_len}")
        if batch_size <= 0:
            raise DataError(f"PromptSampler: batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > dataset_len:
            raise DataError(
                f"PromptSampler: batch size {batch_size} is larger than the dataset ({dataset_len} prompts), so "
                "with drop_last no batch can be formed; lower the batch size or add data"
            )
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_len, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """All indices in the order epoch ``epoch`` visits them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng(self.seed + epoch).permutation(self.dataset_len)
            else:
                self._order = np.arange(self.dataset_len)
            self._order_epoch = epoch
        return self._order.tolist()

    def next_batch(self) -> list[int]:
        """The next batch of indices (moving into the next epoch when this one is used up)."""
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        batch = order[start : start + self.batch_size]
        self.position += 1
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, **{k: getattr(self, k) for k in _SETUP_KEYS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "position"):
            if key not in state:
                raise DataError(f"PromptSampler.load_state_dict: the state has no {key!r} (keys: {sorted(state)})")
        for key in _SETUP_KEYS:
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"PromptSampler.load_state_dict: the checkpoint was taken with {key}={state[key]!r} but this run "
                    f"has {key}={getattr(self, key)!r}; resuming would not continue the same sequence of batches"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise DataError(
                f"PromptSampler.load_state_dict: invalid position epoch={epoch}, position={position} "
                f"({self.batches_per_epoch} batches per epoch)"
            )
        self.epoch, self.position = epoch, position
