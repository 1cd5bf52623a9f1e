"""Every storage a torch op creates, charged while it lives: the device ledger's allocator.

A GPU's allocator sees every allocation, whoever makes it; a list of named holders sees only what it was told about
(a log-prob pass that keeps every micro-batch's autograd graph is invisible to it). ``AllocationMeter`` is a
``TorchDispatchMode``: every aten op that runs while it is active passes through it, and each output tensor whose
storage it has not seen is charged with the storage's bytes until the storage is freed (a finalizer on the storage:
its Python object lives exactly as long as the storage). Views share their base's storage and cost nothing, and a view
or in-place result of a storage the meter did not charge (a host buffer made while paused, a tensor from before
metering) is no new allocation. In-place ops that resize a storage (``resize_``, ``set_``) are re-read; ``recharge``
re-reads a storage resized outside dispatch (``UntypedStorage.resize_``, the hand-off's release and restore).

``live`` is the bytes held now, ``peak`` the most held since ``reset_peak``. ``paused()`` leaves a block out: what the
modelled engine allocates for itself (it is charged as vLLM reserves it, not per tensor) and host buffers.

What it cannot see: storages made outside dispatch (``torch.from_numpy``, ``torch.frombuffer``), and CPU work that a
GPU run would also keep on the host (the step's batch, its metrics) is charged as device memory: the ledger errs on
the high side.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# In-place ops after which a storage may have changed size.
_RESIZING = {"resize_", "set_", "resize_as_"}


class AllocationMeter(TorchDispatchMode):
    """Charges every storage created by a torch op while active (see the module docstring)."""

    def __init__(self, site_min_bytes: int = 64 * 2**10) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._charged: dict[int, int] = {}  # storage key (StorageImpl address) -> bytes charged
        self._tokens: dict[int, int] = {}  # storage key -> the charge's number (a freed key's address can come back)
        self._next_token = 0
        # Where each storage of at least site_min_bytes was made: the innermost frames of this package.
        self.site_min_bytes = site_min_bytes
        self._sites: dict[int, str] = {}
        self._peak_seen = 0
        self.peak_largest: list[tuple[int, str]] = []  # the largest storages near the peak since reset_peak
        self._paused = threading.local()
        self._lock = threading.Lock()

    # ----- accounting
    def _paused_here(self) -> bool:
        return getattr(self._paused, "depth", 0) > 0

    def _add(self, delta: int) -> None:
        with self._lock:
            self.live += delta
            if self.live > self.peak:
                self.peak = self.live
                # What the peak is made of, re-read as it grows by 1% (and a site's size: not at every small tensor).
                if self.live > self._peak_seen * 1.01 + self.site_min_bytes:
                    self._peak_seen = self.live
                    self.peak_largest = self._largest_locked(6, frozenset())

    def _freed(self, key: int, token: int) -> None:
        with self._lock:
            if self._tokens.get(key) != token:
                return  # forgotten, or the address now belongs to a later storage
            del self._tokens[key]
            nbytes = self._charged.pop(key, 0)
            self._sites.pop(key, None)
            self.live -= nbytes

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Stop charging ``storage``: its bytes are accounted elsewhere (the engine's share)."""
        key = int(storage._cdata)
        with self._lock:
            if self._tokens.pop(key, None) is None:
                return
            self.live -= self._charged.pop(key, 0)
            self._sites.pop(key, None)

    def largest(self, count: int, exclude: set[int] = frozenset()) -> list[tuple[int, str]]:
        """The ``count`` largest live storages not in ``exclude`` (storage keys): (bytes, where it was made)."""
        with self._lock:
            return self._largest_locked(count, exclude)

    def _largest_locked(self, count: int, exclude: set[int]) -> list[tuple[int, str]]:
        sized = [(n, self._sites.get(k, "?")) for k, n in self._charged.items() if k not in exclude and n]
        return sorted(sized, key=lambda x: -x[0])[:count]

    def charge(self, storage: torch.UntypedStorage) -> None:
        """Charge ``storage`` (once) for its current bytes until it is freed."""
        key = int(storage._cdata)
        if key in self._charged:
            return
        nbytes = storage.nbytes()
        self._next_token += 1
        self._charged[key], self._tokens[key] = nbytes, self._next_token
        if nbytes >= self.site_min_bytes:
            self._sites[key] = _site()
        weakref.finalize(storage, self._freed, key, self._next_token)
        self._add(nbytes)

    def recharge(self, storage: torch.UntypedStorage) -> None:
        """Re-read a charged storage's size (it was resized in place); an uncharged one is left alone."""
        key = int(storage._cdata)
        if key not in self._charged:
            return
        nbytes = storage.nbytes()
        with self._lock:
            delta = nbytes - self._charged[key]
            self._charged[key] = nbytes
        self._add(delta)

    def adjust(self, delta: int) -> None:
        """Charge (or give back) ``delta`` bytes held by something the meter does not see tensor by tensor."""
        self._add(delta)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self._peak_seen = self.live
            self.peak_largest = self._largest_locked(6, frozenset())

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing created in the block (on this thread) is charged."""
        self._paused.depth = getattr(self._paused, "depth", 0) + 1
        try:
            yield
        finally:
            self._paused.depth -= 1

    # ----- the dispatch hook
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._paused_here():
            return out
        resized = func.__name__.split(".")[0] in _RESIZING
        inputs = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if resized:
                    self.recharge(storage)
                if int(storage._cdata) in self._charged:
                    continue
                if inputs is None:  # a view or an in-place result shares an input's storage: nothing was made
                    inputs = {_key(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
                if int(storage._cdata) not in inputs:
                    self.charge(storage)
        return out


def _key(t: torch.Tensor) -> int:
    return -1 if t.is_meta else int(t.untyped_storage()._cdata)


def _site() -> str:
    """The innermost three frames of this package (or of anything, if none) on the stack: where a storage was made."""
    stack = [f for f in traceback.extract_stack() if f.filename != __file__]  # not the meter's own frames
    frames = [f for f in stack if "megatron_dapo" in f.filename] or stack
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
