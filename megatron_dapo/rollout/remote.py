"""What passes between the two sides of an asynchronous job (trainer.mode=async, docs/async.md).

Two channels (``parallel.Placement``):

* the **bridge** carries the weights: one group per *sending* training rank with every rollout rank
  (``parallel.open_bridge``; gloo on CPU, NCCL/HCCL for device tensors on accelerators: ``Platform.bridge_group``).
  ``rollout/weight_transfer/owner_push.OwnerPush`` decides which training rank sends which tensor (the rank that owns
  it: its pipeline stage, its expert-parallel rank, TP rank 0 after a gather to it) and hands each of its parts of a
  bucket, HF tensors already resharded and cast as for a colocated engine, to ``BridgeSender``, which broadcasts it
  without waiting: the trainer goes on while the push is in flight. ``BridgeReceiver`` takes a bucket's parts from
  their senders in the plan's order and loads them into the rollout ranks' engines as one reload call (a bucket is
  whole vLLM layers). Every rollout rank receives every bucket, as every colocated rank does (vLLM slices its TP
  shard);
* the job's **store** (torchrun's key-value store) carries the small things: ``StoreQueue``, the bounded queue of
  scored groups (one key per group, FIFO), and ``Control``, named JSON messages (the start, weight versions, the
  bridge's plan, validation and snapshot requests and their results, statistics, stop).

A push is announced first (``Control`` key ``weights``); the rollout ranks take it at their next round boundary, so
generation never drains. The training ranks announce a push only once the previous one has arrived
(``BridgeSender.wait``): one push is in flight at most.

A wait on the store for the other side (``StoreQueue.get``, ``Control.wait``) fails as soon as it finds a rank of the
job dead (``raise_if_peer_died``), rather than after ``trainer.collective_timeout_s``: a killed rank is then named
first and a torchrun restart (``MAX_RESTARTS``) does not wait for the timeout.
"""

from __future__ import annotations

import datetime
import json
import pickle
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo import dtypes, liveness
from megatron_dapo.parallel import Placement, broadcast_object, open_bridge
from megatron_dapo.rollout.weight_transfer.reload_transport import quiet_partial_reload_logs

PREFIX = "async/"
BRIDGE_PLAN = "bridge/plan"  # Control: {"key", "senders": training ranks, "buckets": [[sender index, ...], ...]}
# A wait for the other side looks this often whether a rank of the job died (liveness.py): with a peer gone the wait
# would last trainer.collective_timeout_s, and a torchrun restart with it. A peer on another host costs a check
# liveness.STALE_BEATS heartbeats, hence not every poll.
PEER_CHECK_S = 5.0


_DEATHS: list[str] = []  # the ranks this process found dead: a later wait (the save after the failure) fails at once


def raise_if_peer_died(what: str) -> None:
    """``RuntimeError`` naming the ranks of the job that are gone (either side), while this rank waits for ``what``;
    ``run_training`` then reports the dead rank first (``training/failure.dead_peer_report``)."""
    if not _DEATHS:
        alive = liveness.current()
        dead = alive.dead_peers() if alive is not None else []
        if dead:
            _DEATHS.append(", ".join(f"rank {d.rank} ({d.role})" for d in dead))
    if _DEATHS:
        raise RuntimeError(f"{_DEATHS[0]} died while this rank waited for {what}")


def _broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    """From bridge rank 0 (the sender) to the others; returns the work, not waited for."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return pg.broadcast([tensor], opts)


class BridgeSender:
    """The training side's end of a weight push, ``OwnerPush``'s target. On a sending rank each ``load_weights``
    (its part of a bucket: a header, then one flat tensor on the platform's device) is broadcast over its bridge group
    and not waited for; the flat tensor is a copy, so the next step may change the weights meanwhile. ``wait`` waits
    for everything in flight. Without a placement (``place`` None) or on a rank that sends nothing it sends nothing."""

    def __init__(self, place: Optional[Placement], rollout_plan: Any, platform: Any) -> None:
        self.place, self.rollout_plan, self.platform = place, rollout_plan, platform
        self.group: Any = None
        self.sent_bytes = 0  # over the bridge, by this rank, over the run
        self._in_flight: list[tuple[Any, torch.Tensor]] = []

    def open(self, senders: list[int], buckets: list[list[int]]) -> None:
        """Every training rank, once the senders are known (``senders``: training ranks; ``buckets``: per bucket the
        indices of its senders, in the order the rollout ranks receive them): the first training rank posts the plan
        under a new key, each sender opens its group (it returns once the rollout ranks have opened theirs)."""
        if self.place is None:
            return
        rank = dist.get_rank()
        key = None
        if rank == 0:
            key = str(int(self.place.store.add(PREFIX + "bridge/plans", 1)))  # a new plan opens new groups
            plan = {"key": key, "senders": senders, "buckets": buckets}
            Control(self.place.store, self.place.timeout_s).post(BRIDGE_PLAN, plan)
        key = broadcast_object(key)
        if rank in senders:
            self.group = open_bridge(self.place, f"{key}/{senders.index(rank)}")

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.group is None:
            return
        device = self.platform.device()
        header, flat = pack_weights(weights, device)  # a copy, sent while training goes on
        data = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=device)
        for tensor in (size, data, flat):
            self._in_flight.append((_broadcast(self.group, tensor), tensor))
        self.sent_bytes += flat.numel() * flat.element_size()

    def after_weight_update(self) -> None:
        """Nothing to mark: the rollout ranks know a push's buckets and senders from the plan."""

    def wait(self) -> float:
        """Wait until the push in flight has reached the rollout ranks; returns the seconds waited."""
        started = time.perf_counter()
        for work, _ in self._in_flight:
            work.wait()
        if self._in_flight:
            self.platform.synchronize()  # NCCL/HCCL: wait() orders streams; the host waits here
        self._in_flight = []
        return time.perf_counter() - started


class BridgeReceiver:
    """The rollout side's end: a push's buckets, each from its senders, into the engine (one reload call per
    bucket), then the engine's post-update (``RolloutEngine.after_weight_update``)."""

    def __init__(self, place: Placement, engine: Any, platform: Any) -> None:
        self.place, self.engine, self.platform = place, engine, platform
        self.key: Optional[str] = None
        self.groups: list[Any] = []

    def receive(self) -> int:
        """One whole push (collective over the rollout ranks); returns the bytes received."""
        leader = dist.get_rank() == 0
        control = Control(self.place.store, self.place.timeout_s)
        plan = broadcast_object(control.wait(BRIDGE_PLAN, "the weight bridge's plan") if leader else None)
        if plan["key"] != self.key:  # the training side planned anew: its senders' groups, in order
            self.groups = [open_bridge(self.place, f"{plan['key']}/{i}") for i in range(len(plan["senders"]))]
            self.key = plan["key"]
        received = 0
        with quiet_partial_reload_logs():
            for senders in plan["buckets"]:
                weights: list[tuple[str, torch.Tensor]] = []
                for s in senders:
                    received += self._part(self.groups[s], weights)
                self.engine.load_weights(weights)
        self.engine.after_weight_update()
        return received

    def _part(self, group: Any, out: list[tuple[str, torch.Tensor]]) -> int:
        """One sender's part of a bucket, appended to ``out``; returns its bytes."""
        device = self.platform.device()
        size = torch.empty(1, dtype=torch.long, device=device)
        _broadcast(group, size).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _broadcast(group, data).wait()
        header = pickle.loads(data.cpu().numpy().tobytes())
        flat = torch.empty(packed_bytes(header), dtype=torch.uint8, device=device)
        _broadcast(group, flat).wait()
        out.extend(unpack_weights(header, flat))
        return flat.numel()


Header = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype name) per tensor of a bridge message


def pack_weights(weights: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[Header, torch.Tensor]:
    """One bridge message: its header and the tensors' bytes, each tensor in its own dtype (a Gated DeltaNet's A_log
    travels in fp32 among bf16 ones: ``weight_transfer/transport.engine_dtype``)."""
    header = [(name, tuple(t.shape), dtypes.config_name(t.dtype)) for name, t in weights]
    return header, torch.cat([t.reshape(-1).to(device).contiguous().view(torch.uint8) for _, t in weights])


def packed_bytes(header: Header) -> int:
    return sum(_numel(shape) * dtypes.from_config_name(dt, "weight push").itemsize for _, shape, dt in header)


def unpack_weights(header: Header, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``pack_weights``' tensors back out of ``flat`` (views where aligned)."""
    out, offset = [], 0
    for name, shape, dt in header:
        dtype = dtypes.from_config_name(dt, "weight push")
        n = _numel(shape) * dtype.itemsize
        raw = flat[offset : offset + n]
        # A view as a wider dtype needs an aligned offset (an fp32 tensor after an odd number of bf16 values).
        out.append((name, (raw if offset % dtype.itemsize == 0 else raw.clone()).view(dtype).view(shape)))
        offset += n
    return out


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
        """The next group; waits up to the timeout for the producer (``RuntimeError`` naming the wait, or the rank
        that died meanwhile)."""
        key = self._key(self.consumed)
        if _DEATHS:
            raise_if_peer_died(f"scored group #{self.consumed}")
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            chunk = max(0.001, min(PEER_CHECK_S, deadline - time.monotonic()))
            began = time.monotonic()
            try:
                self.store.wait([key], datetime.timedelta(seconds=chunk))
                break
            except Exception as exc:  # noqa: BLE001 - the store raises its own error types per backend
                if time.monotonic() >= deadline or time.monotonic() - began < 0.5 * chunk:  # timed out, or broken
                    raise RuntimeError(
                        f"no scored group came from the rollout ranks within trainer.collective_timeout_s="
                        f"{self.timeout.total_seconds():.0f} s (waiting for group #{self.consumed}): {exc}"
                    ) from exc
                raise_if_peer_died(f"scored group #{self.consumed}")
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
        checked = time.monotonic()
        while time.monotonic() < deadline:
            value = self.read(name)
            if value is not None:
                return value
            if _DEATHS or time.monotonic() - checked > PEER_CHECK_S:
                raise_if_peer_died(what)
                checked = time.monotonic()
            time.sleep(poll_s)
        raise RuntimeError(f"waited trainer.collective_timeout_s={self.timeout_s:.0f} s for {what}")
