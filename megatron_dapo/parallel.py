"""torch.distributed and megatron-core ``parallel_state`` from torchrun's environment + config: initialisation, the
CPU control group, small collectives, and ``teardown`` at the end of the process."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_dapo import liveness
from megatron_dapo.config import ParallelConfig
from megatron_dapo.platform import Platform, get_platform, init_platform


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info_from_env() -> DistInfo:
    """Rank/world from torchrun's variables (a single process without torchrun is rank 0 of 1)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


_CONTROL_GROUP: Optional[dist.ProcessGroup] = None
_PLACEMENT: Optional[Placement] = None


@dataclass(frozen=True)
class Placement:
    """trainer.mode=async (docs/async.md): the job's ranks split into two worlds. The first ``train_ranks`` ranks train
    and the last ``rollout_ranks`` generate; each side's default process group holds its own ranks only (megatron-core
    and vLLM each see their side as the world). Between the sides: the job's key-value ``store`` (torchrun's; the
    queue of scored groups and the control messages) and the weight bridge: one group per sending training rank and
    every rollout rank, opened once the training side knows which ranks send (``open_bridge``)."""

    role: str  # "train" or "rollout"
    global_rank: int
    world_size: int  # the job's
    train_ranks: int
    rollout_ranks: int
    store: Any
    platform: Any  # whose backend the bridge takes (Platform.bridge_group)
    timeout_s: float = 600.0

    @property
    def bridge_rank(self) -> int:
        """This rank in a bridge group: the sending training rank is 0, rollout rank k is k + 1."""
        return 0 if self.role == "train" else self.global_rank - self.train_ranks + 1


def open_bridge(place: Placement, key: str) -> Any:
    """One weight bridge group (``rollout/remote.py``): a sending training rank and every rollout rank, over the job's
    store under ``bridge/<key>``, with the platform's backend for tensors on its device (``Platform.bridge_group``:
    gloo on CPU, NCCL/HCCL on accelerators). Only its members call it; it returns once all of them have."""
    store = dist.PrefixStore(f"bridge/{key}", place.store)
    timeout = datetime.timedelta(seconds=place.timeout_s)
    return place.platform.bridge_group(store, place.bridge_rank, place.rollout_ranks + 1, timeout)


def placement() -> Optional[Placement]:
    """This process's side of an asynchronous job (None in synchronous mode)."""
    return _PLACEMENT


def role_of(global_rank: int, world_size: int, rollout_ranks: int) -> str:
    """``rollout`` for the last ``rollout_ranks`` ranks of the job, ``train`` for the others."""
    return "rollout" if rollout_ranks and global_rank >= world_size - rollout_ranks else "train"


def init_distributed(
    parallel: ParallelConfig, timeout_s: float = 600.0, rollout_ranks: int = 0
) -> tuple[DistInfo, Platform]:
    """Choose the platform, bind the device and create the default process group (idempotent).

    With ``rollout_ranks`` (trainer.mode=async) the job splits into its two sides (``Placement``): the default group
    and the returned ``DistInfo`` are this rank's side, and ``RANK``/``WORLD_SIZE`` are rewritten to the side's, as
    vLLM's external launcher and megatron-core read them; ``placement()`` holds the rest.

    ``timeout_s`` bounds every collective wait (gloo, NCCL, HCCL): a peer that died or hangs surfaces as an error
    instead of a hang. Besides the default group (the platform's backend) a CPU ``gloo`` group over all ranks is
    created for the trainer's small host-side control messages (stop requests, skip decisions): see
    ``control_group``.
    """
    global _CONTROL_GROUP
    platform = init_platform(parallel.platform)
    info = dist_info_from_env()
    platform.set_device(info.local_rank)
    if rollout_ranks and not dist.is_initialized():
        info = _init_disaggregated(platform, info, rollout_ranks, timeout_s)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = attempt_store(info, timeout)
        dist.init_process_group(
            backend=platform.dist_backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
        )
        liveness.start(store, info.rank, info.world_size, "training")
    # A mixed default group ("cpu:gloo,cuda:nccl") takes CPU tensors already.
    if _CONTROL_GROUP is None and "gloo" not in str(dist.get_backend()):
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return info, platform


def attempt_store(info: DistInfo, timeout: datetime.timedelta) -> dist.Store:
    """The job's rendezvous store (``env://``: torchrun's, or MASTER_ADDR/MASTER_PORT), under a prefix of this
    attempt: torchrun restarts a job (``--max-restarts``, launch/run_node.sh's MAX_RESTARTS) on the store of its first
    attempt, so without it a restarted rank reads its predecessors' keys (a dead rank's address, its failure report:
    training/failure.py) and fails again. Every rank of an attempt has the same ``TORCHELASTIC_RESTART_COUNT``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
    return dist.PrefixStore(f"megatron_dapo/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _init_disaggregated(platform: Platform, info: DistInfo, rollout_ranks: int, timeout_s: float) -> DistInfo:
    """Rendezvous on the job's store, then this side's default group (the weight bridge opens at the first push:
    ``open_bridge``); returns this rank's place in its side."""
    global _PLACEMENT
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(info, timeout)
    role = role_of(info.rank, info.world_size, rollout_ranks)
    train_ranks = info.world_size - rollout_ranks
    first = 0 if role == "train" else train_ranks
    side = DistInfo(info.rank - first, train_ranks if role == "train" else rollout_ranks, info.local_rank)
    dist.init_process_group(
        backend=platform.dist_backend,
        store=dist.PrefixStore(f"side/{role}", store),
        rank=side.rank,
        world_size=side.world_size,
        timeout=timeout,
    )
    _PLACEMENT = Placement(role, info.rank, info.world_size, train_ranks, rollout_ranks, store, platform, timeout_s)
    alive = liveness.start(store, info.rank, info.world_size, "training" if role == "train" else "rollout")
    if role == "rollout":
        alive.announce_place(f"rollout rank {side.rank} of {side.world_size}")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(side.rank), str(side.world_size)
    return side


def control_group() -> Optional[dist.ProcessGroup]:
    """A group over all ranks that takes CPU tensors (``None`` = the default group, when that is gloo already)."""
    return _CONTROL_GROUP


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (one tiny all-reduce on the control group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group())
    return bool(value.item())


def init_model_parallel(parallel: ParallelConfig, seed: int = 1, timeout_s: float = 600.0) -> None:
    """Create megatron-core's TP/PP/DP groups, the expert EP/ETP groups (gloo groups too, for CPU-side collectives)
    and seed RNG streams."""
    from megatron.core import parallel_state  # heavy: megatron-core, imported once the platform has patched it

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    get_platform().seed(seed)
    alive = liveness.current()
    if alive is not None:
        alive.announce_place(_place(parallel_state))


def _place(ps: Any) -> str:
    """This rank's place, as a user finds it in the layout: "TP 0, PP 1, DP 0" (CP and EP when they are > 1)."""
    parts = [("TP", ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())]
    parts.append(("PP", ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()))
    parts.append(("CP", ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()))
    parts.append(("DP", ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()))
    parts.append(("EP", ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()))
    return ", ".join(f"{name} {r}" for name, r, size in parts if size > 1 or name in ("TP", "PP", "DP"))


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state  # heavy: megatron-core, imported once the platform has patched it

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


class Stoppable(Protocol):
    """What ``teardown`` stops between megatron-core's groups and the default group (the rollout engine)."""

    def shutdown(self) -> None: ...


def teardown(engine: Optional[Stoppable]) -> None:
    """End of run, in the only order that works: megatron-core's groups, the engine, then the default group.

    The colocated vLLM engine (``rollout.engine.RolloutEngine``) shares the default process group with megatron-core,
    and shutting it down destroys that group: megatron-core's groups must go before it, the default group after.
    Every rank must call it (the first step is a barrier, so no rank destroys the default group while another still
    uses it). ``engine`` is anything with ``shutdown()``; None when no engine was started.
    """
    liveness.stop()  # its heartbeat thread must be out of the store before the default group goes
    if dist.is_initialized():
        dist.barrier()
    destroy_model_parallel()
    if engine is not None:
        engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ collectives (no-ops alone)


def rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Ranks in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Broadcast a picklable object from ``src`` to every rank of the default group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj`` (one collective), in rank order; ``[obj]`` without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_error(local: Optional[str]) -> Optional[str]:
    """The lowest failing rank's message on every rank (None when no rank failed). Collective."""
    msgs = all_gather_object(local)
    failed = [(r, m) for r, m in enumerate(msgs) if m]
    if not failed:
        return None
    first, msg = failed[0]
    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    return f"rank {first}: {msg}{more}" if len(msgs) > 1 else msg


def parallel_layout() -> dict[str, Any]:
    """The parallel layout this rank runs under (world size, TP, PP, VPP, DP; EP/ETP when set): what a checkpoint
    records, and what decides whether its per-rank state (RNG) can be restored."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, imported once the platform has patched it

    layout = {
        "world_size": world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }
    # Expert sizes only when they are not the defaults (EP 1, ETP = TP): layouts recorded before they existed still
    # compare equal, and a change of either (which changes the expert RNG streams) does not.
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ep != 1 or etp != layout["tensor_model_parallel_size"]:
        layout.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return layout
