"""Memory hand-off between the rollout and training phases: actor/reference state to host memory and back.

What moves. megatron-core keeps the actor's state in a few kinds of storage, and every kind is moved the same way —
whole storages, so that every tensor viewing one (a DDP bucket's parameters, ``param.main_grad``, optimizer shards)
follows it without being re-pointed:

* **params**: the DDP-wrapped chunks' parameters. With the distributed optimizer they are views into the buffers'
  ``param_data``; without it each parameter has its own storage. Tied weights share one storage (moved once).
* **grads**: the DDP buffers' ``grad_data`` (every ``param.main_grad`` is a view into it) and the ``.grad`` of the
  optimizer's main parameters (views into ``grad_data`` as well when gradients are reduced in fp32).
* **optimizer**: the torch optimizer state (Adam's ``exp_avg``/``exp_avg_sq``) and the optimizer's own fp32 main
  parameters — the ``Float16OptimizerWithFloat16Params`` copies and the ``DistributedOptimizer`` shards
  (``shard_fp32_from_float16_groups``). Main parameters that *are* model parameters or views of them (fp32 training)
  are left to **params**: moving them twice would break the aliasing the optimizer step relies on.
* **reference**: the frozen reference chunks' parameters and buffers.
* **teacher**: on-policy distillation's frozen teachers (``distill/teacher.py``), moved as the reference is and when
  it is (``HandoffPlan.reference``): ``attach_teachers``, ``before_teacher`` / ``after_teacher`` around their forward.

How. Each component has one host byte buffer, exactly the size of its storages (each slice aligned to
``HOST_ALIGN`` bytes), pinned on CUDA/NPU and kept between cycles (pinning is slow; one buffer per storage would
also pay the pinned allocator's power-of-two rounding on each). Each storage is copied into its slice, the device
is synchronised once, then the storage is resized to 0 bytes (``Platform.release_storage``: the allocator gets the
memory back; the tensor objects stay). Onload resizes it back and copies the bytes in: bit-exact by construction.
The frozen reference is copied out once: its host copy stays valid, later offloads only free the device memory.
This is what verl's ``offload_megatron_model_to_cpu`` / ``load_megatron_model_to_gpu`` and megatron-core's own
``_ParamAndGradBuffer.offload_to_cpu`` do for DDP buffers, applied uniformly to every storage kind; grads may instead
be discarded and re-zeroed (``keep_grad_values=False``, megatron-core's behaviour; the actor zeroes them before
every update anyway). Every device move goes through the platform (``host_buffer``, ``copy_to_host``,
``copy_to_device``, ``release_storage``, ``restore_storage``), so a test platform can count them.

Start-up (``before_engine_start`` / ``after_engine_start`` / ``attach_reference``), as verl orders it: vLLM refuses
to start unless free device memory covers ``rollout.gpu_memory_utilization`` x the device (``request_memory`` in
``vllm/v1/worker/utils.py``), so the actor's grads and optimizer state (and params, if planned) leave before the engine
is built; the engine sleeps as soon as it exists (its weights are dummies until the first sync); the reference is
built after that and leaves at once when planned. A resume loads the optimizer state while the engine sleeps.

Checkpoint saves (``before_save``): a save reads params and optimizer state, so the engine sleeps first (a validation
leaves it awake with its KV cache) and the actor comes back whole; the next ``before_rollout`` starts from there.

Sequence per training step (``MemoryHandoff``; the trainer calls one method at each phase boundary):

1. ``before_rollout(engine, sync_fn)``:
   offload actor grads + optimizer and the reference (as configured) → ``empty_cache`` →
   ``engine.wake_up(["weights"])`` → ``sync_fn()`` (the weight sync reads the actor's params) →
   offload actor params (if configured) → ``empty_cache`` → ``engine.wake_up(["kv_cache"])``. Then generate.
2. ``after_rollout(engine)``: ``engine.sleep(level)`` → ``empty_cache`` → onload actor params (if they were
   offloaded). Then old-policy log-probs (actor params only).
3. ``before_reference()`` / ``after_reference()``: onload the reference for its log-prob forward, offload it again.
4. ``before_update()``: onload grads + optimizer. Then the actor update. The next step starts again at 1.

Per platform (``Platform.memory_handoff_defaults``; each ``actor.offload_*`` / ``ref.offload`` /
``rollout.sleep_level`` set in the config overrides its default):

* CPU: nothing is offloaded (host memory *is* the device memory; the calls above are no-ops by declaration) and
  vLLM has no sleep mode, so ``engine.sleep``/``wake_up`` do nothing.
* CUDA: grads + optimizer + reference offloaded, params kept; vLLM sleep level 2.
* NPU: grads + optimizer + reference offloaded, params kept; vLLM (vllm-ascend) sleep level 2.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_dapo.config.plan import HandoffPlan
from megatron_dapo.platform import Platform

ACTOR = ("params", "grads", "optimizer")
# The frozen models beside the actor, each built after the engine and moved as ``HandoffPlan.reference`` plans: copied
# out once, on the device only for their own forward (``frozen_forward``). ``teacher``: on-policy distillation's
# teachers (distill/teacher.py); ``reward_model``: reward.reward_model (rm/scorer.py).
FROZEN = ("reference", "teacher", "reward_model")
COMPONENTS = ACTOR + FROZEN
# The hand-off's phases (``MemoryHandoff.phase``, ``perf/peak_memory_gb/*``) as check's memory model names them
# (``config/memory.PHASES``): what measured peaks are held against.
PLAN_PHASE_OF = {
    "startup": "startup",
    "weight_sync": "sync",
    "rollout": "gen",
    "old_log_probs": "old_log_prob",
    "reference": "ref",
    "update": "update",
    "save": "save",
}
HOST_ALIGN = 512  # bytes: each storage's slice of a component's host buffer starts at a multiple of this


# ----------------------------------------------------------------------------------------------- tensor discovery


def _ddp_buffers(chunk) -> list:
    return list(getattr(chunk, "buffers", []) or []) + list(getattr(chunk, "expert_parallel_buffers", []) or [])


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def param_tensors(chunks: list) -> list[torch.Tensor]:
    """Every parameter of the (DDP-wrapped or plain) chunks, plus the DDP ``param_data`` buffers."""
    out: list[torch.Tensor] = []
    for chunk in chunks:
        out.extend(p.data for p in chunk.parameters())
        out.extend(b.param_data for b in _ddp_buffers(chunk) if getattr(b, "param_data", None) is not None)
    return out


def reference_tensors(chunks: list) -> list[torch.Tensor]:
    """The frozen reference's parameters and buffers (rotary frequencies, ...)."""
    out: list[torch.Tensor] = []
    for chunk in chunks:
        out.extend(p.data for p in chunk.parameters())
        out.extend(b for b in chunk.buffers() if isinstance(b, torch.Tensor))
    return out


def grad_tensors(chunks: list, optimizer=None) -> list[torch.Tensor]:
    """The DDP grad buffers, any ``.grad``/``.main_grad`` outside them, and the optimizer main params' ``.grad``."""
    out: list[torch.Tensor] = []
    for chunk in chunks:
        out.extend(b.grad_data for b in _ddp_buffers(chunk) if getattr(b, "grad_data", None) is not None)
        for p in chunk.parameters():
            for g in (p.grad, getattr(p, "main_grad", None)):
                if isinstance(g, torch.Tensor):
                    out.append(g)
    if optimizer is not None:
        for opt in _sub_optimizers(optimizer):
            inner = getattr(opt, "optimizer", None)
            for group in getattr(inner, "param_groups", []):
                out.extend(p.grad for p in group["params"] if p.grad is not None)
    return out


def optimizer_tensors(optimizer, exclude: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Optimizer state tensors and main parameters, minus those sharing storage with ``exclude`` (model params)."""
    skip = {_storage_key(t) for t in exclude if t.untyped_storage().nbytes() > 0}
    out: list[torch.Tensor] = []
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        mains: list[torch.Tensor] = [p for group in inner.param_groups for p in group["params"]]
        # Float16 optimizer copies / distributed-optimizer shards also live outside param_groups' order.
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                mains.extend(group)
        out.extend(p.data for p in mains if _storage_key(p) not in skip)
        for state in inner.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _storage_key(t: torch.Tensor) -> int:
    # The StorageImpl's address: the same for every view of one storage, stable across resize_.
    return int(t.untyped_storage()._cdata)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: Optional[torch.Tensor]  # a slice of the component's host buffer; None: values discarded (re-zeroed)
    offloaded: bool = True
    host_current: bool = False  # the host slice holds the storage's value (frozen components: copy once)


@dataclass
class _HostBuffer:
    """One component's host buffer and where each storage's bytes sit in it."""

    buffer: torch.Tensor
    slices: dict[int, tuple[int, int]]  # storage key -> (offset, nbytes)

    def fits(self, sizes: dict[int, int]) -> bool:
        return all(key in self.slices and self.slices[key][1] == n for key, n in sizes.items())

    def view(self, key: int) -> torch.Tensor:
        offset, nbytes = self.slices[key]
        return self.buffer[offset : offset + nbytes]


@dataclass
class OffloadStats:
    """Bytes and storages moved by the last offload/onload of each component, the time it took, and each
    component's host buffer size."""

    bytes: dict[str, int] = field(default_factory=dict)
    storages: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    host_bytes: dict[str, int] = field(default_factory=dict)


class StorageOffloader:
    """Moves whole storages to host buffers and back, per named component; a storage is held by one component."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._held: dict[str, dict[int, _Held]] = {c: {} for c in COMPONENTS}
        self._host: dict[str, _HostBuffer] = {}
        self.stats = OffloadStats()

    def host_buffers(self) -> dict[str, torch.Tensor]:
        """Each component's host buffer (one per component that kept its values)."""
        return {component: host.buffer for component, host in self._host.items()}

    def is_offloaded(self, component: str) -> bool:
        return any(h.offloaded for h in self._held[component].values())

    def _owner(self, key: int) -> Optional[str]:
        for name, held in self._held.items():
            if key in held and held[key].offloaded:
                return name
        return None

    def _unique_storages(self, tensors: Iterable[torch.Tensor]) -> Iterator[tuple[int, torch.UntypedStorage]]:
        seen: set[int] = set()
        device_type = self.platform.device_type
        for t in tensors:
            if t.device.type != device_type:
                continue  # e.g. Adam's CPU ``step`` counter on an accelerator
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            yield key, t.untyped_storage()

    def _host_slices(self, component: str, sizes: dict[int, int]) -> tuple[_HostBuffer, bool]:
        """The component's host buffer holding ``sizes`` (storage key -> bytes), and whether it is the one already
        there (else a new one, exactly sized: the storages changed)."""
        current = self._host.get(component)
        if current is not None and current.fits(sizes):
            return current, True
        if self.is_offloaded(component):
            raise RuntimeError(f"offload of {component!r}: its storages changed while some of them are offloaded")
        slices, offset = {}, 0
        for key, nbytes in sizes.items():
            slices[key] = (offset, nbytes)
            offset += -(-nbytes // HOST_ALIGN) * HOST_ALIGN
        if current is not None:
            self.platform.free_host_buffer(current.buffer)
        host = _HostBuffer(self.platform.host_buffer(offset), slices)
        self._host[component] = host
        self.stats.host_bytes[component] = offset
        return host, False

    @torch.no_grad()
    def offload(
        self, component: str, tensors: Iterable[torch.Tensor], keep_values: bool = True, frozen: bool = False
    ) -> int:
        """Copy every distinct storage behind ``tensors`` to the component's host buffer, then free it. Returns the
        bytes released. ``frozen``: the values never change, so a host copy made by an earlier offload is kept."""
        start = time.perf_counter()
        held = self._held[component]
        # Skip empty storages and those already off the device (e.g. shared with another component).
        storages = {
            key: storage
            for key, storage in self._unique_storages(tensors)
            if storage.nbytes() and self._owner(key) is None
        }
        host, reuse_copies = None, False
        if keep_values and storages:
            host, same = self._host_slices(component, {key: s.nbytes() for key, s in storages.items()})
            reuse_copies = frozen and same
        moving: list[_Held] = []
        for key, storage in storages.items():
            previous = held.get(key)
            entry = _Held(storage=storage, nbytes=storage.nbytes(), host=None if host is None else host.view(key))
            entry.host_current = reuse_copies and previous is not None and previous.host_current
            if entry.host is not None and not entry.host_current:
                self.platform.copy_to_host(entry.host, _bytes_view(storage))
                entry.host_current = frozen
            held[key] = entry
            moving.append(entry)
        self.platform.synchronize()  # copies done before the memory is handed back
        for entry in moving:
            self.platform.release_storage(entry.storage)
        moved = sum(e.nbytes for e in moving)
        self._record(component, moved, len(moving), start)
        return moved

    @torch.no_grad()
    def onload(self, component: str) -> int:
        """Re-allocate the component's storages and copy their bytes back (or zero them if values were discarded)."""
        start = time.perf_counter()
        restored = [e for e in self._held[component].values() if e.offloaded]
        for entry in restored:
            self.platform.restore_storage(entry.storage, entry.nbytes)
            view = _bytes_view(entry.storage)
            if entry.host is None:
                view.zero_()
            else:
                self.platform.copy_to_device(view, entry.host)
            entry.offloaded = False
        self.platform.synchronize()
        moved = sum(e.nbytes for e in restored)
        self._record(component, moved, len(restored), start)
        return moved

    def close(self) -> None:
        """Give every host buffer back to the platform (CUDA/NPU: unregistered before the memory can be reused).
        The run is over: an offloaded component's values go with its buffer."""
        for host in self._host.values():
            self.platform.free_host_buffer(host.buffer)
        self._host.clear()

    def _record(self, component: str, nbytes: int, count: int, start: float) -> None:
        self.stats.bytes[component] = nbytes
        self.stats.storages[component] = count
        self.stats.seconds[component] = time.perf_counter() - start


# ----------------------------------------------------------------------------------------- functional primitives


def offload_actor_params(off: StorageOffloader, chunks: list) -> int:
    return off.offload("params", param_tensors(chunks))


def offload_actor_grads(off: StorageOffloader, chunks: list, optimizer=None, keep_values: bool = True) -> int:
    return off.offload("grads", grad_tensors(chunks, optimizer), keep_values=keep_values)


def offload_optimizer(off: StorageOffloader, optimizer, chunks: list) -> int:
    return off.offload("optimizer", optimizer_tensors(optimizer, exclude=param_tensors(chunks)))


def offload_reference(off: StorageOffloader, ref_chunks: list, component: str = "reference") -> int:
    return off.offload(component, reference_tensors(ref_chunks), frozen=True)


class MemoryHandoff:
    """Phase-boundary memory moves for one rank: the actor (DDP chunks + megatron optimizer), the reference, and
    the colocated rollout engine. See the module docstring for the sequence and the per-platform plan.

    The trainer calls, at start-up::

        handoff.before_engine_start(); engine = RolloutEngine(...); handoff.after_engine_start(engine)
        handoff.attach_reference(ref_chunks)            # built after the engine (when a KL term needs one)

    every step::

        handoff.before_rollout(engine, lambda: weight_sync.sync(actor_chunks))
        batch = engine.generate(...)
        handoff.after_rollout(engine)
        old_log_probs = actor.compute_log_probs(...)
        handoff.before_reference(); ref_log_probs = ref.compute_log_probs(...); handoff.after_reference()
        handoff.before_update()
        actor.update(...)

    and around a checkpoint save or load: ``before_save(engine)`` (or ``restore_actor()`` while the engine sleeps).

    ``phase_peaks_gb`` holds the platform's peak memory of each phase (``startup``, ``rollout``, ``old_log_probs``,
    ``reference``, ``update``, ``save``) measured between the calls; ``metrics()`` returns them with the moved bytes
    and the host buffers under ``perf/`` names. With nothing to offload (CPU) only the peaks are recorded.
    """

    def __init__(
        self,
        platform: Platform,
        plan: HandoffPlan,
        actor_chunks: list,
        optimizer=None,
        ref_chunks: Optional[list] = None,
    ) -> None:
        self.platform = platform
        self.plan = plan
        self.actor_chunks = actor_chunks
        self.optimizer = optimizer
        self.frozen: dict[str, list] = {name: [] for name in FROZEN}  # each frozen model's chunks, once attached
        self.frozen["reference"] = ref_chunks or []
        self.offloader = StorageOffloader(platform)
        self.phase_peaks_gb: dict[str, float] = {}
        self.phase: Optional[str] = None
        # Whether memory is ever given back between phases: on a device (its allocator caches), or with a planned
        # offload or an engine that sleeps. Not on CPU by default (nothing offloaded, no sleep mode): there
        # ``_empty_cache`` skips its full garbage collection, which changes nothing there.
        self.releases = platform.has_device_memory or any((plan.params, plan.grads, plan.optimizer, plan.reference))
        platform.observe_handoff(self)

    # ----- phase bookkeeping
    def _enter(self, phase: Optional[str]) -> None:
        if self.phase is not None:
            self.phase_peaks_gb[self.phase] = self.platform.peak_memory_gb()
        self.phase = phase
        self.platform.reset_peak_memory()

    def _empty_cache(self) -> None:
        """Give released memory back to the platform's allocator; nothing to do when nothing is ever released (a
        full collection of a process holding vLLM and megatron-core costs milliseconds, several times a step)."""
        if not self.releases:
            return
        gc.collect()
        self.platform.empty_cache()

    def _offload_training_state(self) -> None:
        """Grads, optimizer state and the reference leave the device, as planned."""
        p = self.plan
        if p.grads and self.optimizer is not None:
            offload_actor_grads(self.offloader, self.actor_chunks, self.optimizer, keep_values=p.keep_grad_values)
        if p.optimizer and self.optimizer is not None:
            offload_optimizer(self.offloader, self.optimizer, self.actor_chunks)
        for name, chunks in self.frozen.items():
            if p.reference and chunks:
                offload_reference(self.offloader, chunks, name)
        self._empty_cache()

    def _onload(self, components: Iterable[str]) -> None:
        for component in components:
            if self.offloader.is_offloaded(component):
                self.offloader.onload(component)

    # ----- start-up and checkpoints
    def before_engine_start(self) -> None:
        """Before vLLM is built: what the rollout phase does not keep leaves the device (vLLM's start-up check wants
        ``gpu_memory_utilization`` x the device free)."""
        self._enter("startup")
        self._offload_training_state()
        if self.plan.params:
            offload_actor_params(self.offloader, self.actor_chunks)
            self._empty_cache()

    def after_engine_start(self, engine: Any) -> None:
        """The new engine sleeps until the first rollout (its weights are dummies until the first sync)."""
        self.releases = self.releases or bool(getattr(engine, "sleep_supported", True))
        engine.sleep(self.plan.sleep_level)
        self._empty_cache()
        self._enter(None)

    @property
    def ref_chunks(self) -> list:
        return self.frozen["reference"]

    @property
    def teacher_chunks(self) -> list:
        return self.frozen["teacher"]

    def attach_frozen(self, name: str, chunks: list) -> None:
        """A frozen model (one of ``FROZEN``), built after the engine: it leaves the device at once when planned and
        comes back for its own forward only (``frozen_forward``)."""
        if name not in FROZEN:
            raise ValueError(f"memory hand-off: unknown frozen model {name!r}; expected one of {FROZEN}")
        self.frozen[name] = chunks
        self.platform.observe_handoff(self)
        if self.plan.reference and chunks:
            offload_reference(self.offloader, chunks, name)
            self._empty_cache()

    def attach_reference(self, ref_chunks: list) -> None:
        self.attach_frozen("reference", ref_chunks)

    def attach_teachers(self, teacher_chunks: list) -> None:
        """Every distillation teacher's chunks, as one frozen model."""
        self.attach_frozen("teacher", teacher_chunks)

    def restore_actor(self) -> None:
        """Bring every offloaded part of the actor back (a checkpoint load or save reads it). Only while the engine
        sleeps: ``before_save`` makes sure of that."""
        self._onload(ACTOR)

    def before_save(self, engine: Any) -> None:
        """A save never shares the device with an awake engine: the engine sleeps (a validation leaves it awake
        with its KV cache), then the actor comes back whole. The next ``before_rollout`` starts from here. (No
        engine in async mode: the rollout ranks hold it.)"""
        if engine is not None:  # its memory belongs to the phase before (validation), not to the save's window
            engine.sleep(self.plan.sleep_level)
        self._empty_cache()
        self._enter("save")
        self.restore_actor()

    def after_save(self) -> None:
        self._enter(None)

    # ----- the step
    def before_rollout(self, engine: Any, sync_fn: Callable[[], Any]) -> Any:
        """Free training state, wake the engine's weights, sync, free params (if planned), wake the KV cache.

        Returns what ``sync_fn`` returned (the sync's metrics)."""
        self._enter(None)
        self._offload_training_state()
        self._onload(["params"])  # the sync reads them (offloaded only at start-up, before the first sync)
        self._enter("weight_sync")
        engine.wake_up(["weights"])
        result = sync_fn()
        if self.plan.params:
            offload_actor_params(self.offloader, self.actor_chunks)
        self._empty_cache()
        engine.wake_up(["kv_cache"])
        self._enter("rollout")
        return result

    def after_rollout(self, engine: Any) -> None:
        """Put the engine to sleep (planned level), give its memory back, bring the actor's params back."""
        engine.sleep(self.plan.sleep_level)
        self._empty_cache()
        self._enter("old_log_probs")  # each phase's window holds what it brings back, not what the last one freed
        self._onload(["params"])

    def before_frozen(self, name: str, own_phase: bool = True) -> None:
        """A frozen model's forward starts: it comes back to the device, in a phase of its own (``own_phase``) or
        inside the current one (the reward model scores between generation rounds: the rollout phase's window)."""
        if own_phase:
            self._enter(name)
        self._onload([name])

    def after_frozen(self, name: str, own_phase: bool = True) -> None:
        """Its forward is done: it leaves again, as planned."""
        if self.plan.reference and self.frozen[name]:
            offload_reference(self.offloader, self.frozen[name], name)
            self._empty_cache()
        if own_phase:
            self._enter("between")

    @contextmanager
    def frozen_forward(self, name: str, own_phase: bool = True) -> Iterator[None]:
        """``before_frozen`` ... ``after_frozen`` around a frozen model's forward."""
        self.before_frozen(name, own_phase)
        try:
            yield
        finally:
            self.after_frozen(name, own_phase)

    def before_reference(self) -> None:
        self.before_frozen("reference")

    def after_reference(self) -> None:
        self.after_frozen("reference")

    def before_teacher(self) -> None:
        self.before_frozen("teacher")

    def after_teacher(self) -> None:
        self.after_frozen("teacher")

    def before_update(self) -> None:
        """Bring grads and optimizer state back for the actor update."""
        self._enter("update")
        self._onload(ACTOR)

    def end_step(self) -> None:
        """Close the update phase's peak window (call after the optimizer step, before ``metrics``)."""
        self._enter(None)

    def close(self) -> None:
        """At the end of the run: the host buffers go back to the platform."""
        self.offloader.close()

    def metrics(self) -> dict[str, float]:
        out = {f"perf/peak_memory_gb/{k}": v for k, v in self.phase_peaks_gb.items()}
        for k, v in self.offloader.stats.bytes.items():
            out[f"perf/offload_gb/{k}"] = v / 2**30
        for k, v in self.offloader.stats.host_bytes.items():
            out[f"perf/offload_host_buffer_gb/{k}"] = v / 2**30
        return out
