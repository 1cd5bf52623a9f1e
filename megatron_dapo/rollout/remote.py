"""What passes between the two sides of an asynchronous job (trainer.mode=async, docs/async.md).

Two channels (``parallel.Placement``):

* the **bridge**, a gloo group of the first training rank (bridge rank 0) and every rollout rank, carries the weights:
  ``BridgeSender`` is ``WeightSync``'s target on the training side, through the ``reload`` transport
  (``rollout/weight_transfer/reload_transport.py``; one header and one flat tensor per bucket of HF tensors, already
  resharded and cast as for a colocated engine); ``BridgeReceiver`` loads them into the rollout ranks' engines.
  Every rollout rank receives every bucket, as every colocated rank does (vLLM slices its TP shard);
* the job's **store** (torchrun's key-value store) carries the small things: ``StoreQueue``, the bounded queue of
  scored groups (one key per group, FIFO), and ``Control``, named JSON messages (the start, weight versions,
  validation and snapshot requests and their results, statistics, stop).

A push is announced first (``Control`` key ``weights``); the rollout ranks take it at their next round boundary, so
the trainer waits at most one segment's generation for them, and generation never drains.
"""

from __future__ import annotations

import datetime
import json
import pickle
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.rollout.weight_transfer.reload_transport import quiet_partial_reload_logs

PREFIX = "async/"


def _broadcast(pg: Any, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([tensor], opts).wait()


def bridge_object(pg: Any, obj: Any = None, root: bool = False) -> Any:
    """``obj`` from bridge rank 0 on every bridge rank (pickled; a length, then the bytes)."""
    data = pickle.dumps(obj) if root else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    _broadcast(pg, size)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if root else torch.empty(int(size), dtype=torch.uint8)
    _broadcast(pg, buf)
    return obj if root else pickle.loads(buf.numpy().tobytes())


class BridgeSender:
    """The training side's end of a weight push, in the place of a colocated engine for ``WeightSync``: on bridge rank
    0 each bucket goes over the bridge; the other training ranks take part in the gathers only."""

    def __init__(self, bridge: Any, rollout_plan: Any, platform: Any) -> None:
        self.bridge, self.rollout_plan, self.platform = bridge, rollout_plan, platform

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.bridge is None:
            return
        header = [(name, tuple(t.shape), dtypes.config_name(t.dtype)) for name, t in weights]
        bridge_object(self.bridge, header, root=True)
        flat = torch.cat([t.reshape(-1) for _, t in weights]).cpu()  # gloo carries host tensors
        _broadcast(self.bridge, flat)

    def after_weight_update(self) -> None:
        if self.bridge is not None:
            bridge_object(self.bridge, None, root=True)  # the end of this push


class BridgeReceiver:
    """The rollout side's end: buckets from the bridge into the engine until the end mark, then the engine's
    post-update (``RolloutEngine.after_weight_update``)."""

    def __init__(self, bridge: Any, engine: Any) -> None:
        self.bridge, self.engine = bridge, engine

    def receive(self) -> int:
        """One whole push; returns the bytes received."""
        with quiet_partial_reload_logs():
            received = self._buckets()
        self.engine.after_weight_update()
        return received

    def _buckets(self) -> int:
        received = 0
        while True:
            header = bridge_object(self.bridge)
            if header is None:
                return received
            dtype = dtypes.from_config_name(header[0][2], "weight push") if header else torch.float32
            flat = torch.empty(sum(_numel(shape) for _, shape, _ in header), dtype=dtype)
            _broadcast(self.bridge, flat)
            tensors, offset = [], 0
            for name, shape, _ in header:
                tensors.append((name, flat[offset : offset + _numel(shape)].view(shape)))
                offset += _numel(shape)
            self.engine.load_weights(tensors)
            received += flat.numel() * flat.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class StoreQueue:
    """Scored groups from the rollout side's first rank to the training side's, one store key per group, in order.
    Counters ``q/produced`` and ``q/consumed`` live in the store, so either side can see the queue's length."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store, self.timeout = store, datetime.timedelta(seconds=timeout_s)
        self.produced = 0  # on the producer
        self.consumed = 0  # on the consumer

    def _key(self, seq: int) -> str:
        return f"{PREFIX}q/{seq}"

    def put(self, payload: bytes) -> None:
        self.store.set(self._key(self.produced), payload)
        self.produced = int(self.store.add(f"{PREFIX}q/produced", 1))

    def get(self) -> bytes:
        """The next group; waits up to the timeout for the producer (``RuntimeError`` naming the wait)."""
        key = self._key(self.consumed)
        try:
            self.store.wait([key], self.timeout)
        except Exception as exc:  # noqa: BLE001 - the store raises its own error types per backend
            raise RuntimeError(
                f"no scored group came from the rollout ranks within trainer.collective_timeout_s="
                f"{self.timeout.total_seconds():.0f} s (waiting for group #{self.consumed}): {exc}"
            ) from exc
        payload = self.store.get(key)
        self.store.delete_key(key)
        self.consumed = int(self.store.add(f"{PREFIX}q/consumed", 1))
        return payload

    def length(self) -> int:
        """Groups put and not yet taken."""
        return int(self.store.add(f"{PREFIX}q/produced", 0)) - int(self.store.add(f"{PREFIX}q/consumed", 0))

    def waiting(self) -> list[bytes]:
        """The groups put and not yet taken, oldest first, left in place (for a snapshot: the consumer is waiting
        for the snapshot, so it takes nothing meanwhile)."""
        first = int(self.store.add(f"{PREFIX}q/consumed", 0))
        last = int(self.store.add(f"{PREFIX}q/produced", 0))
        return [self.store.get(self._key(seq)) for seq in range(first, last)]


class Control:
    """Named JSON messages in the store (``async/<name>``)."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store, self.timeout_s = store, timeout_s

    def post(self, name: str, value: Any) -> None:
        self.store.set(PREFIX + name, json.dumps(value))

    def read(self, name: str) -> Optional[Any]:
        """The message, or None when it was never posted."""
        if not self.store.check([PREFIX + name]):
            return None
        return json.loads(self.store.get(PREFIX + name))

    def wait(self, name: str, what: str, poll_s: float = 0.01) -> Any:
        """The message, once posted; ``RuntimeError`` naming ``what`` was awaited after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            value = self.read(name)
            if value is not None:
                return value
            time.sleep(poll_s)
        raise RuntimeError(f"waited trainer.collective_timeout_s={self.timeout_s:.0f} s for {what}")
