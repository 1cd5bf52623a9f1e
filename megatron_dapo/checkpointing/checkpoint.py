"""Training checkpoints: megatron-core ``dist_checkpointing`` for model + optimizer, plus the trainer's own state.

A checkpoint is one directory ``<save_dir>/global_step_<n>``::

    dist_ckpt/            a megatron-core dist checkpoint in Megatron-LM's layout (``model``, or ``model0``,
                          ``model1``, ... = virtual pipeline stages; ``optimizer``; ``checkpoint_version``,
                          ``iteration`` in common.pt), saved by every rank in parallel (torch_dist format; resharded
                          on load). The model part is the format of ``megatron_dapo/weights/dist_format.py``: a
                          step directory is also a ``checkpoint.load_dir`` and an ``mcore-to-hf`` input
    rng/rank_<r>.pt       every rank's generators (python, numpy, torch, megatron's tensor-parallel tracker)
    trainer_state.json    step, lr-scheduler state, the parallel layout it was saved with, and the registered
                          components' states: data position, the trainer's counters, the KL controller
    config.yaml           the resolved experiment config

Atomicity: everything is written into ``<save_dir>/.tmp-step_<n>``, which is renamed to ``global_step_<n>`` only
after every rank finished; the ``latest`` marker (``global_step_<n>``) is replaced last (write + ``os.replace``).
A crash at any point leaves the previous checkpoint and ``latest`` untouched; a stale ``.tmp-*`` directory is
ignored and removed by the next save (``megatron_dapo/weights/atomic.py`` holds the rename/fsync helpers, shared with
the converter). Checkpoints beyond ``max_ckpt_to_keep`` are renamed to ``.tmp-delete-*`` at once and deleted by a
background thread of rank 0. Assumes a file system shared by all ranks (as Megatron-LM does).

Layout changes on load: model weights are resharded by ``dist_checkpointing`` for any TP/PP/DP change. The
non-distributed optimizer's state is keyed like the parameters, so it reshards the same way. The distributed
optimizer is saved in megatron-core's ``dp_reshardable`` format: a different DP size loads, a different TP/PP does
not (megatron-core's ``fully_reshardable`` format would allow it but fails with torch's Adam, which keeps a
per-parameter ``step`` tensor — the case on CPU and on GPUs without TransformerEngine/Apex). RNG states are
restored only when the layout (world size, TP, PP, VPP) is unchanged; otherwise the seeded generators are kept and
``rng_restored`` is False. The padded vocabulary grows with TP (``make_vocab_size_divisible_by`` × TP): the saved
embedding/output rows load and the extra padding rows keep their initial values (megatron-core's
``allow_shape_mismatch``). A change of the virtual pipeline size is not supported.

With torch's Adam (no TransformerEngine/Apex) megatron-core's DistributedOptimizer neither restores Adam's ``step``
nor keeps it per parameter on load; ``_restore_torch_adam_steps`` sets it from ``trainer_state.json``.

Integrity: ``manifest.json`` in the step directory lists every file with its size and checksum (XXH3-64; the
version 1 manifests of older checkpoints hold CRC-32 and still verify: ``megatron_dapo/weights/integrity.py``), hashed
as the bytes are written: megatron-core's tensor files by our writer (``BucketWriter``), rng/trainer_state/config as
we write them; only megatron-core's three small bookkeeping files (``common.pt``, ``.metadata``, ``metadata.json``),
written inside megatron-core, are hashed by rank 0 right after they are written (page cache), and fsynced then.
``load``/``resolve_resume`` verify sizes and checksums first (the ranks
split the files, one collective agrees) and raise ``CheckpointIntegrityError`` naming the step directory, the file
and expected vs found ("truncated" / "corrupt"); ``resume_mode=auto`` falls back to the newest intact checkpoint
with a warning. A checkpoint without a manifest (written before manifests existed) loads with a warning.

No non-finite weight: ``save`` refuses (before any rank writes anything) a state whose floating model or optimizer
tensors hold NaN/inf, naming the first such tensor.

Writing, through megatron-core's public API: ``dist_checkpointing.save(..., async_sharded_save=True)`` with its
``TorchDistSaveShardedStrategy`` plans the save (rank 0 writes ``common.pt``) and returns the file writing as an
``AsyncRequest`` (the write buckets, one per file; the queue its finalisation reads the write results from; the
finalize functions, which write ``.metadata`` and ``metadata.json``). We execute the request ourselves
(``megatron_dapo/weights/dist_writer.py``): the buckets' tensors are staged in host buffers kept for the run
(``HostStaging``: device tensors, and every tensor of a background save; a CPU tensor of a synchronous save is written
in place, a view through an exact-storage alias where megatron-core would clone it), and threads of the rank write
one file each in megatron-core's item format, hashed as written, the disk started on the bytes every 64 MB, one
fsync per file (``BucketWriter``). The wait on them is bounded by ``timeout_s``: a writer that fails or does not
finish raises ``CheckpointError`` on every rank naming the file and the step, and the temporary directory is never
published. Then the results go into the request's queue and megatron-core's finalize functions run. megatron-core's
own executor would fork one helper process per file and wait for them without a time limit. That queue is
megatron-core's process-wide ``multiprocessing`` manager, started with ``spawn`` at a process's first save (a few
seconds, once; the CPU shims replace it by an in-process queue): it re-imports the launching script, so scripts run
under torchrun keep their work under ``if __name__ == "__main__"``.

Background saves (``save(blocking=False)``): the save returns once the state is staged in host memory and the small
files are written; the tensor files are written while training goes on, and ``finalize`` (collective; called by the
next ``save`` first, and by the caller before it exits) waits for them and publishes the step. Until then ``latest``
names the previous step; a process killed meanwhile leaves an unpublished ``.tmp-step_<n>``, which the next save
removes. A failed background write raises ``CheckpointError`` from that ``finalize``.

Components (``Stateful``: ``state_dict``/``load_state_dict``, torchtitan's pattern) registered with the manager are
saved in ``trainer_state.json`` under their names and restored in place by ``load``; the trainer registers itself
(``trainer``: its counters), its KL controller (``kl_ctrl``) and its prompt sampler (``data_state``, the entry's name
since format 1). A checkpoint without a component's entry (saved before it was registered) loads with a warning and
leaves that component as constructed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import torch
import yaml

from megatron_dapo.models.builder import unwrap
from megatron_dapo.models.lora import is_adapter_param, lora_modules_present
from megatron_dapo.parallel import agree_error, all_gather_object, barrier, parallel_layout, rank, world_size
from megatron_dapo.platform import get_platform
from megatron_dapo.weights.atomic import publish_dir, write_text_atomic
from megatron_dapo.weights.checkpoint_errors import CheckpointError, CheckpointIntegrityError
from megatron_dapo.weights.dist_format import (
    COMMON_FILE,
    DCP_METADATA_FILE,
    MCORE_METADATA_FILE,
    TRAINING_DIST_SUBDIR,
    common_state,
    model_sharded_state_dict,
    model_state_key,
)
from megatron_dapo.weights.dist_writer import BucketWriter, HostStaging, exact_storage
from megatron_dapo.weights.integrity import (
    MANIFEST_NAME,
    FileRecord,
    durable_file_record,
    first_non_finite,
    manifest_problem,
    torch_save_hashed,
    write_bytes_hashed,
    write_manifest,
)

log = logging.getLogger("megatron_dapo.checkpoint")

FORMAT_VERSION = 1
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp-step_"
LATEST = "latest"
DIST_DIR = TRAINING_DIST_SUBDIR
RNG_DIR = "rng"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
DIST_OPTIM_FORMAT = "dp_reshardable"
DEFAULT_TIMEOUT_S = 600.0
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")
# Written by megatron-core itself (rank 0), hashed right after it wrote them.
_MCORE_BOOKKEEPING = (COMMON_FILE, DCP_METADATA_FILE, MCORE_METADATA_FILE)


# --------------------------------------------------------------------------------------------- integrity


def _named_state_tensors(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, local tensor) of every tensor in a megatron-core sharded state dict: ShardedTensor/factory data by
    their checkpoint key, tensors inside ShardedObjects and plain entries by key/path."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out: list[tuple[str, torch.Tensor]] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)):
            if isinstance(x.data, torch.Tensor):
                out.append((x.key, x.data))
        elif isinstance(x, ShardedObject):
            walk(x.data, x.key)
        elif isinstance(x, torch.Tensor):
            out.append((path, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(tree, prefix)
    return out


_verified: dict[str, tuple[int, int]] = {}  # step dir -> (mtime_ns, size) of the manifest whose checksums passed


def _manifest_stamp(step_dir: Path) -> Optional[tuple[int, int]]:
    try:
        st = (step_dir / MANIFEST_NAME).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def checkpoint_problem(step_dir: Union[str, Path], collective: Optional[bool] = None) -> Optional[str]:
    """Why ``step_dir`` cannot be loaded (incomplete, or a file that does not match the manifest), or None.

    Collective when torch.distributed is initialized (``collective=None``): the ranks split the checksum reads and
    agree with one ``all_gather_object``, so every rank returns the same answer. Checksums of a directory already
    verified in this process (same manifest) are not re-read; sizes always are.
    """
    step_dir = Path(step_dir)
    if collective is None:
        collective = world_size() > 1
    missing = missing_parts(step_dir) if step_dir.is_dir() else ["the directory itself"]
    local: Optional[str] = None
    if missing:
        local = f"incomplete (missing: {', '.join(missing)})"
    else:
        stamp = _manifest_stamp(step_dir)
        checksum = stamp is None or _verified.get(str(step_dir.resolve())) != stamp
        # Collective: this rank's share of the checksums; alone: one process verifies everything itself.
        share = (rank(), world_size()) if collective else (0, 1)
        local = manifest_problem(step_dir, checksum, *share)
    if collective:
        local = next((m for m in all_gather_object(local) if m), None)
    if local is None and not missing and _manifest_stamp(step_dir) is not None:
        _verified[str(step_dir.resolve())] = _manifest_stamp(step_dir)
    return local


def _warn_if_no_manifest(step_dir: Path) -> None:
    if step_dir.is_dir() and not (step_dir / MANIFEST_NAME).is_file() and rank() == 0:
        log.warning(
            "checkpoint %s has no %s (saved before manifests existed): loading it without an integrity check",
            step_dir,
            MANIFEST_NAME,
        )


# ------------------------------------------------------------------------------------ megatron-core's request


class _ExactStoragePlanner:
    """megatron-core's save planner, its tensors resolved to exact-storage aliases (``exact_storage``): megatron-core's
    ``FileSystemWriterAsync.prepare_write_data`` then finds no CPU view to clone, and the writer writes the views'
    own bytes in place (the clone was a copy of every such view into freshly faulted memory, at every save)."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner

    def resolve_data(self, write_item: Any) -> Any:
        data = self.planner.resolve_data(write_item)
        return exact_storage(data.detach()) if isinstance(data, torch.Tensor) else data


@contextlib.contextmanager
def _views_not_cloned() -> Iterator[None]:
    """megatron-core's torch_dist strategy, for this block, builds its file writer as the subclass whose
    ``prepare_write_data`` resolves through ``_ExactStoragePlanner`` (what it hands back is unchanged otherwise).
    A megatron-core without that module attribute keeps its own writer (and its clones)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch  # heavy: megatron-core

    base = getattr(mcore_torch, "FileSystemWriterAsync", None)
    if base is None:
        yield
        return

    class _InPlaceViewsWriter(base):
        def prepare_write_data(self, plan: Any, planner: Any) -> None:
            super().prepare_write_data(plan, _ExactStoragePlanner(planner))

    mcore_torch.FileSystemWriterAsync = _InPlaceViewsWriter
    try:
        yield
    finally:
        mcore_torch.FileSystemWriterAsync = base


def _request_buckets(request: Any) -> tuple[Optional[list], Optional[str]]:
    """This rank's write buckets in megatron-core's ``AsyncRequest`` (``dist_checkpointing.save(...,
    async_sharded_save=True)``): (buckets or None when this rank writes nothing, error). Its arguments as megatron-core
    documents them (``AsyncRequest.execute_sync``, ``get_save_function_and_args``): this rank, the write buckets (one
    per file), the queue its finalisation reads the write results from. Its ``preload_fn`` (``.to("cpu")`` into
    fresh pageable memory) is not run: ``HostStaging`` makes the host copies."""
    if request.async_fn is None:  # nothing to write on this rank
        return None, None
    args = list(request.async_fn_args)
    if len(args) != 3:
        return None, (
            f"megatron-core's AsyncRequest has {len(args)} write arguments, expected 3 (rank, write buckets, results "
            "queue): this megatron-core version's checkpoint writer is not supported"
        )
    return list(args[1]), None


def _hand_back_results(request: Any, done: dict[int, Any]) -> None:
    """Give megatron-core's finalisation (``FileSystemWriterAsync.retrieve_write_results``) this rank's write results
    through the queue the request names. The queue lives as long as the process (megatron-core's, shared by every
    save): an entry a failed save left behind is dropped first, or the next save would read it as its own."""
    if request.async_fn is None:
        return
    results_queue = request.async_fn_args[2]
    while True:
        try:
            results_queue.get_nowait()
        except queue.Empty:
            break
    results_queue.put(done)


def _async_save_kwargs(save_fn: Any) -> dict[str, Any]:
    """``dist_checkpointing.save`` arguments that return the file writing as megatron-core's ``AsyncRequest``."""
    kwargs: dict[str, Any] = {"async_sharded_save": True}
    try:
        params = inspect.signature(save_fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if "async_strategy" in params:  # newer megatron-core defaults to nvidia-resiliency-ext's request type
        kwargs["async_strategy"] = "mcore"
    return kwargs


@dataclass
class _PendingSave:
    """A save whose files are being written: what its completion (``CheckpointManager.finalize``) needs."""

    step: int
    tmp: Path
    final: Path
    request: Any  # megatron-core's AsyncRequest: its finalize functions write .metadata and metadata.json
    writer: Optional[BucketWriter]  # None: nothing to write on this rank, or staging failed (``error``)
    records: list[FileRecord]  # this rank's files written so far
    started: float
    error: Optional[str] = None


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import DistributedOptimizer  # heavy: megatron-core, once the platform has patched it

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def _torch_adams(optimizer) -> list:
    """Per chained optimizer: its torch ``Adam``/``AdamW`` when it is a ``DistributedOptimizer`` over one, else None.

    Without TransformerEngine/Apex (always on CPU) megatron-core runs torch's Adam, which keeps a per-parameter
    ``step`` tensor in its state. megatron-core 0.16's DistributedOptimizer mishandles that ``step``:
      * building its state dict asserts on a never-stepped optimizer (no ``step`` yet) — ``_prime_torch_adams``;
      * loading leaves ``step`` at its pre-load value and makes one tensor shared by all parameters, which torch
        then increments once per parameter per step — ``_restore_torch_adam_steps`` (from ``trainer_state.json``).
    """
    from megatron.core.optimizer import DistributedOptimizer  # heavy: megatron-core, once the platform has patched it

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        out.append(inner if isinstance(opt, DistributedOptimizer) and isinstance(inner, torch.optim.Adam) else None)
    return out


def _torch_adam_steps(optimizer) -> list[Optional[float]]:
    steps = []
    for inner in _torch_adams(optimizer):
        values = {float(st["step"]) for st in inner.state.values() if "step" in st} if inner is not None else set()
        # All parameters step together (megatron gives every main parameter a gradient); max() guards the record.
        steps.append(max(values) if values else None)
    return steps


def _prime_torch_adams(optimizer) -> None:
    """Give never-stepped parameters the state torch's Adam would create on its first step (zeros, step 0)."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups if inner is not None else []:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


def _restore_torch_adam_steps(optimizer, steps: list[Optional[float]]) -> None:
    for inner, step in zip(_torch_adams(optimizer), steps):
        if inner is None or step is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                # One tensor per parameter: torch's Adam increments each parameter's step in place.
                inner.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)


def _sharded_state_dict(model_chunks: list, optimizer, is_loading: bool, step: Optional[int] = None) -> dict:
    """Megatron-LM's layout (``megatron_dapo/weights/dist_format.py``, shared with the converter): ``model`` (or
    ``model0``, ``model1``... per virtual stage), ``optimizer``, and when saving ``checkpoint_version`` and
    ``iteration``."""
    state: dict[str, Any] = model_sharded_state_dict(model_chunks)
    if lora_modules_present(model_chunks):
        # LoRA: the adapters alone; the frozen base is the run's checkpoint.load_dir (the ``lora`` component).
        state = {key: {n: t for n, t in sd.items() if is_adapter_param(n)} for key, sd in state.items()}
    if step is not None:
        state.update(common_state(step))
    if optimizer is not None:
        metadata = {"distrib_optim_sharding_type": DIST_OPTIM_FORMAT} if _uses_distributed_optimizer(optimizer) else {}
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def missing_parts(step_dir: Union[str, Path]) -> list[str]:
    """What a complete checkpoint directory has and ``step_dir`` lacks (empty list = complete)."""
    step_dir = Path(step_dir)
    missing = [
        part
        for part in (STATE_FILE, f"{DIST_DIR}/{MCORE_METADATA_FILE}", f"{DIST_DIR}/{DCP_METADATA_FILE}", RNG_DIR)
        if not (step_dir / part).exists()
    ]
    if STATE_FILE not in missing:
        try:
            state = json.loads((step_dir / STATE_FILE).read_text())
            world = int(state["layout"]["world_size"])
        except (ValueError, KeyError, TypeError):
            return missing + [f"{STATE_FILE} (unreadable)"]
        if RNG_DIR not in missing:
            missing += [
                f"{RNG_DIR}/{_rng_name(r)}" for r in range(world) if not (step_dir / RNG_DIR / _rng_name(r)).exists()
            ]
    return missing


def _rng_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def complete_checkpoints(save_dir: Union[str, Path]) -> list[tuple[int, Path]]:
    """(step, path) of the complete ``global_step_<n>`` directories under ``save_dir``, by step."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and not missing_parts(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def _newest_intact(save_dir: Path) -> Optional[Path]:
    """``resume_mode=auto``: the ``latest`` marker's step first, then the other ``global_step_<n>`` from the highest
    step down; each damaged one is logged and passed over."""
    candidates: list[Path] = []
    marker = save_dir / LATEST
    if marker.is_file():
        candidates.append(save_dir / marker.read_text().strip())
    steps = []
    for child in save_dir.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            steps.append((int(m.group(1)), child))
    candidates += [p for _, p in sorted(steps, reverse=True) if p not in candidates]
    first_damage = None
    for target in candidates:
        problem = checkpoint_problem(target)
        if problem is None:
            return target
        why = f"{target} is damaged: {problem}"
        if rank() == 0:
            log.warning("checkpoint.resume_mode=auto: skipping %s; trying an older checkpoint", why)
        first_damage = first_damage or why
    if first_damage is None:
        return None
    raise CheckpointIntegrityError(
        f"checkpoint.resume_mode=auto: no intact checkpoint in {save_dir}; newest: {first_damage}"
    )


def _named_step_dir(resume_mode: str) -> Path:
    """``resume_mode`` naming a step directory: it must exist, be complete and match its manifest."""
    path = Path(resume_mode)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.resume_mode={resume_mode!r}: no such checkpoint directory (expected auto, disable or a "
            f"{STEP_PREFIX}<n> directory)"
        )
    missing = missing_parts(path)
    if missing:
        hint = ""
        if (path / LATEST).is_file():
            hint = f"; it looks like a save_dir (it has a '{LATEST}' marker): pass a {STEP_PREFIX}<n> directory in it"
        raise CheckpointError(
            f"checkpoint.resume_mode={resume_mode!r}: {path} is not a complete checkpoint (missing: "
            f"{', '.join(missing)}){hint}"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointIntegrityError(
            f"checkpoint.resume_mode={resume_mode!r}: checkpoint {path} is damaged: {problem}"
        )
    return path


def resolve_resume(resume_mode: str, save_dir: Optional[Union[str, Path]]) -> Optional[Path]:
    """Which checkpoint to resume from, verified against its manifest (``checkpoint_problem``).

    ``disable`` → None; ``auto`` → the newest intact checkpoint: the step directory named by ``<save_dir>/latest``
    first, then the other complete ``global_step_<n>`` directories from the highest step down; every damaged one
    passed over is logged as a WARNING with the reason. None when ``save_dir`` holds no checkpoint at all;
    ``CheckpointIntegrityError`` (naming the newest one's damage) when it holds only damaged ones. Anything else is
    a path to a step directory, which must exist, be complete and match its manifest.
    Collective when torch.distributed is initialized (every rank calls it; see ``checkpoint_problem``).
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        if save_dir is None or not Path(save_dir).is_dir():
            return None
        return _newest_intact(Path(save_dir))
    return _named_step_dir(resume_mode)


# --------------------------------------------------------------------------------------------------- manager


class Stateful(Protocol):
    """A component whose state a checkpoint carries in ``trainer_state.json`` (torchtitan's ``Stateful``): the trainer's
    counters, the KL controller, the prompt sampler. ``state_dict`` returns JSON-serialisable data; ``load_state_dict``
    gets what ``state_dict`` returned in the run that saved, and leaves a field the state lacks as it is (so a
    checkpoint written before a field existed still loads, with the constructed default)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# trainer_state.json's own entries; a component cannot be registered under one of them.
_RESERVED_STATE_KEYS = frozenset(
    {
        "format_version",
        "step",
        "scheduler",
        "has_optimizer",
        "distributed_optimizer",
        "torch_adam_steps",
        "num_model_chunks",
        "adapters_only",
        "layout",
        "saved_at",
    }
)


class CheckpointManager:
    """Save/load training checkpoints under ``save_dir``; keep at most ``max_ckpt_to_keep`` (None/<=0: all).

    Besides the model, optimizer and scheduler given to ``save``/``load``, a checkpoint carries the state of every
    registered component (``register`` or ``states=``): ``save`` stores each one's ``state_dict()`` in
    ``trainer_state.json`` under its name, ``load`` restores each one in place.
    """

    def __init__(
        self,
        save_dir: Union[str, Path],
        max_ckpt_to_keep: Optional[int] = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        states: Optional[Mapping[str, Stateful]] = None,
    ) -> None:
        """``timeout_s`` bounds every wait on the checkpoint writer threads (``save``, ``finalize``)."""
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"CheckpointManager(timeout_s={timeout_s!r}): expected a positive number of seconds")
        self.save_dir = Path(save_dir)
        self.max_ckpt_to_keep = max_ckpt_to_keep
        self.timeout_s = float(timeout_s)
        self.states: dict[str, Stateful] = {}
        self._pending: Optional[_PendingSave] = None
        self._cleanup: Optional[threading.Thread] = None
        self._staging: Optional[HostStaging] = None  # made by the first save
        for name, component in (states or {}).items():
            self.register(name, component)

    def register(self, name: str, component: Stateful) -> None:
        """Checkpoint ``component`` as ``trainer_state.json``'s entry ``name``."""
        if name in _RESERVED_STATE_KEYS or name in self.states:
            taken = "reserved by trainer_state.json" if name in _RESERVED_STATE_KEYS else "registered already"
            raise ValueError(f"CheckpointManager.register({name!r}): the name is {taken}")
        self.states[name] = component

    def component_states(self) -> dict[str, dict[str, Any]]:
        """Every registered component's ``state_dict()``, by name: what ``save`` stores (and what a trainer keeps as
        its step-boundary snapshot)."""
        return {name: component.state_dict() for name, component in self.states.items()}

    def load_component_states(self, states: Mapping[str, Any]) -> list[str]:
        """Restore every registered component from ``states`` (by name); returns the names ``states`` lacks (an older
        checkpoint): those components keep their current state."""
        missing = []
        for name, component in self.states.items():
            if states.get(name) is None:
                missing.append(name)
            else:
                component.load_state_dict(states[name])
        return missing

    # ------------------------------------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        model_chunks: list,
        optimizer=None,
        scheduler=None,
        data_state: Optional[dict] = None,
        config: Optional[dict] = None,
        save_optimizer: bool = True,
        blocking: bool = True,
    ) -> Path:
        """Collective (every rank calls it). Returns the final step directory. ``data_state`` is the data position for
        a caller without a component registered as ``data_state``.

        ``blocking=False``: returns once the state is snapshotted into host memory (``HostStaging``) and the small
        files are written; the tensor files are written in the background and the step is published by
        ``finalize`` (collective), which the next ``save`` calls first. Until then ``latest`` names the previous step.

        Raises ``CheckpointIntegrityError`` (every rank, nothing written) when a floating model/optimizer tensor is
        non-finite, and ``CheckpointError`` (every rank, temporary directory unpublished, ``latest`` unchanged) when
        writing fails, e.g. a writer thread fails or does not finish within ``timeout_s`` (for ``blocking=False``:
        raised by the ``finalize`` that completes it).
        """
        self.finalize()  # the previous background save completes (or raises) before this one touches the directory
        started = time.perf_counter()
        tmp = self.save_dir / f"{TMP_PREFIX}{step}"
        final = self.save_dir / step_dir_name(step)
        # The generators as they are when the caller asks for the save (nothing below should draw, but be exact).
        rng = {"rank": rank(), "layout": parallel_layout(), "state": get_platform().rng_state()}
        saved_optimizer = optimizer if save_optimizer else None
        if saved_optimizer is not None:
            _prime_torch_adams(saved_optimizer)
        # Fail before any rank writes anything if the rank-0-only payload cannot be serialised.
        states = self.component_states()
        if data_state is not None:
            if "data_state" in states:
                raise ValueError("CheckpointManager.save: data_state given, but a component is registered under it")
            states["data_state"] = data_state
        state_text = _trainer_state_text(step, model_chunks, optimizer, scheduler, states, save_optimizer)
        sharded = _sharded_state_dict(model_chunks, saved_optimizer, is_loading=False, step=step)
        self._refuse_non_finite(model_chunks, sharded, final)
        self._make_tmp(tmp)
        # The small files first: the tensor files' writer threads, started last, then have the cores to themselves.
        records = [torch_save_hashed(rng, tmp / RNG_DIR / _rng_name(rank()))]
        if rank() == 0:
            records += _write_rank0_files(tmp, state_text, config)
        pending = self._start_writing(step, sharded, tmp, final, background=not blocking)
        pending.started, pending.records = started, records
        self._pending = pending
        if blocking:
            self.finalize()
        return final

    @property
    def pending_step(self) -> Optional[int]:
        """The step of a save still being written in the background (``save(blocking=False)``), else None."""
        return self._pending.step if self._pending is not None else None

    def finalize(self) -> Optional[Path]:
        """Collective. Complete the pending save, if any: wait for its files (at most ``timeout_s``), let
        megatron-core write its metadata, write the manifest, publish the step directory, move ``latest`` to it and
        rotate. Returns the published directory (None: nothing was pending). A failure on any rank raises
        ``CheckpointError`` on every rank; the step stays unpublished and ``latest`` unchanged."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        done, records, error = ({}, [], pending.error)
        if pending.writer is not None and error is None:
            done, records, error = pending.writer.wait(self.timeout_s)
        error = agree_error(error)
        if error is not None:
            raise CheckpointError(
                f"saving checkpoint {pending.final} failed: {error}; {pending.tmp} was not published, "
                f"{self.save_dir / LATEST} is unchanged"
            )
        _hand_back_results(pending.request, done)
        for finalize in pending.request.finalize_fns:  # megatron-core's .metadata and metadata.json (collective)
            finalize()
        tmp, final = pending.tmp, pending.final
        records += pending.records
        if rank() == 0:
            bookkeeping = [tmp / DIST_DIR / name for name in _MCORE_BOOKKEEPING]
            records += [durable_file_record(path) for path in bookkeeping if path.is_file()]
        # Every rank's files are in place; rank 0 gets their records (this is the barrier).
        everyone = all_gather_object([(os.path.relpath(r.path, tmp), r.size, r.digest) for r in records])
        if rank() == 0:
            write_manifest(
                tmp, [FileRecord(Path(rel).as_posix(), size, dig) for recs in everyone for rel, size, dig in recs]
            )
            self._commit(tmp, final)
            self._rotate(keep=final)
        barrier()
        if rank() == 0:
            log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - pending.started)
        return final

    def _refuse_non_finite(self, model_chunks: list, sharded: dict, final: Path) -> None:
        """``CheckpointIntegrityError`` on every rank when any rank's model or optimizer holds NaN/inf. Collective."""
        # Model tensors by module name (layer index included), then the optimizer's state by checkpoint key.
        named = [
            (f"model{i}.{n}", t)
            for i, chunk in enumerate(model_chunks)
            for n, t in unwrap(chunk).state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor)
        ]
        named += _named_state_tensors(sharded.get("optimizer"), "optimizer")
        bad = [(r, name) for r, name in enumerate(all_gather_object(first_non_finite(named))) if name]
        if bad:
            where = f" on rank {bad[0][0]}" if world_size() > 1 else ""
            raise CheckpointIntegrityError(
                f"refusing to save checkpoint {final}: tensor {bad[0][1]!r}{where} holds non-finite values (NaN/inf);"
                f" nothing was written, {self.save_dir / LATEST} and earlier checkpoints are unchanged"
            )

    def _make_tmp(self, tmp: Path) -> None:
        """Rank 0 creates the temporary step directory (removing stale ones first); every rank waits for it."""
        if rank() == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            self.wait_for_cleanup()
            for stale in self.save_dir.glob(".tmp-*"):  # left by a crashed save or deletion
                if stale.is_dir():
                    shutil.rmtree(stale)
            (tmp / DIST_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        barrier()

    def _start_writing(self, step: int, sharded: dict, tmp: Path, final: Path, background: bool) -> _PendingSave:
        """megatron-core plans the dist checkpoint of ``sharded`` (rank 0 also writes ``common.pt``) and hands its
        tensor files back as write buckets; they are staged in host memory (device tensors always, all of them for a
        ``background`` save) and written by a ``BucketWriter``. Collective (the planning, whose errors propagate as
        megatron-core raises them); a failure after it is kept in the pending save and agreed on by ``finalize``, so
        that no rank waits for a failed one."""
        # heavy: megatron-core, once the platform has patched it
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        with _views_not_cloned():
            request = dist_checkpointing.save(
                sharded,
                str(tmp / DIST_DIR),
                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1),
                **_async_save_kwargs(dist_checkpointing.save),
            )
        pending = _PendingSave(step, tmp, final, request, writer=None, records=[], started=time.perf_counter())
        try:
            buckets, pending.error = _request_buckets(request)
            if buckets:
                staged = self._host_staging().stage(buckets, host_too=background)
                pending.writer = BucketWriter(staged, f"{final.name} (being written in {tmp})").start()
        except Exception as e:  # noqa: BLE001 - agreed in finalize so that no rank waits for a failed one
            pending.error = f"{type(e).__name__}: {e}"
        return pending

    def _host_staging(self) -> HostStaging:
        """Host copies of the saved tensors (device tensors; all of them for a background save), kept for the run."""
        if self._staging is None:
            platform = get_platform()
            self._staging = HostStaging(platform.host_buffer, platform.free_host_buffer, platform.synchronize)
        return self._staging

    def _commit(self, tmp: Path, final: Path) -> None:
        # Re-saving a step (e.g. after resuming from it): swap, then delete the old copy.
        publish_dir(tmp, final, backup=final.with_name(f".tmp-replaced-{final.name}"))
        write_text_atomic(self.save_dir / LATEST, final.name + "\n")

    def _rotate(self, keep: Path) -> None:
        """Drop the oldest checkpoints beyond ``max_ckpt_to_keep``: each is renamed out of sight at once (no
        half-deleted ``global_step_<n>`` is ever visible), and deleted by a background thread (freeing a checkpoint's
        page cache takes a while; the next save waits for it, and any leftover ``.tmp-*`` is removed by it)."""
        if not self.max_ckpt_to_keep or self.max_ckpt_to_keep <= 0:
            return
        others = [(s, p) for s, p in complete_checkpoints(self.save_dir) if p != keep]
        excess = len(others) + 1 - self.max_ckpt_to_keep
        doomed = []
        for _, path in others[: max(excess, 0)]:  # lowest steps first
            doomed.append(path.with_name(f".tmp-delete-{path.name}"))
            os.rename(path, doomed[-1])
        if doomed:
            self.wait_for_cleanup()
            self._cleanup = threading.Thread(
                target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed], daemon=True
            )
            self._cleanup.start()

    def wait_for_cleanup(self) -> None:
        """Wait for the deletion of rotated-out checkpoints (``_rotate``) to finish."""
        if self._cleanup is not None:
            self._cleanup.join()
            self._cleanup = None

    # ------------------------------------------------------------------------------------------------ load

    def load(
        self,
        step_dir: Union[str, Path],
        model_chunks: list,
        optimizer=None,
        scheduler=None,
        load_optimizer: bool = True,
        load_rng: bool = True,
    ) -> dict[str, Any]:
        """Collective. Restores model chunks, optimizer (when saved and requested), scheduler, RNG and the registered
        components in place. A component the checkpoint has no entry for (saved before it was registered) keeps its
        state, with a warning.

        Returns ``{"step", "data_state", "config", "path", "optimizer_restored", "rng_restored", "missing_states"}``.
        """
        step_dir = Path(step_dir)
        state = _read_trainer_state(step_dir, len(model_chunks))
        _check_lora_kind(step_dir, state, lora_modules_present(model_chunks))
        # Components first: one that checks the checkpoint against the run (``lora``) says why before the load fails.
        missing = self.load_component_states(state)
        restore_optimizer = bool(load_optimizer and optimizer is not None and state["has_optimizer"])
        if restore_optimizer:
            _check_optimizer_fits(step_dir, state, optimizer)
        _load_model_and_optimizer(step_dir, state, model_chunks, optimizer, restore_optimizer)
        if scheduler is not None and state.get("scheduler") is not None:
            # megatron-core's load_state_dict *adds* the saved step count to the current one.
            scheduler.num_steps = 0
            scheduler.load_state_dict(state["scheduler"])
        rng_restored = load_rng and _restore_rng(step_dir, state["layout"])
        if missing and rank() == 0:
            log.warning(
                "checkpoint %s has no state for %s (saved before it was checkpointed): kept as initialised",
                step_dir,
                ", ".join(missing),
            )
        config = None
        if (step_dir / CONFIG_FILE).is_file():
            config = yaml.safe_load((step_dir / CONFIG_FILE).read_text())
        barrier()
        return {
            "step": int(state["step"]),
            "data_state": state.get("data_state"),
            "config": config,
            "path": step_dir,
            "optimizer_restored": restore_optimizer,
            "rng_restored": rng_restored,
            "missing_states": missing,
        }


# ------------------------------------------------------------------------------------------ save/load parts


def _trainer_state_text(
    step: int, model_chunks: list, optimizer, scheduler, states: dict[str, Any], save_optimizer: bool
) -> str:
    """``trainer_state.json``: the checkpoint's own entries, then the components' states by name (``data_state``: the
    data position, present since format 1; ``trainer``, ``kl_ctrl``: added later, absent from older checkpoints)."""
    return json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "data_state": None,
            **states,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "has_optimizer": bool(save_optimizer and optimizer is not None),
            "distributed_optimizer": optimizer is not None and _uses_distributed_optimizer(optimizer),
            "torch_adam_steps": _torch_adam_steps(optimizer) if optimizer is not None else [],
            "num_model_chunks": len(model_chunks),
            "adapters_only": lora_modules_present(model_chunks),
            "layout": parallel_layout(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        indent=2,
    )


def _write_rank0_files(tmp: Path, state_text: str, config: Optional[dict]) -> list[FileRecord]:
    """Rank 0's part: ``trainer_state.json`` and ``config.yaml``, with their records."""
    records = [write_bytes_hashed(tmp / STATE_FILE, state_text.encode("utf-8"))]
    if config is not None:
        text = yaml.safe_dump(config, sort_keys=False)
        records.append(write_bytes_hashed(tmp / CONFIG_FILE, text.encode("utf-8")))
    return records


def _read_trainer_state(step_dir: Path, num_chunks: int) -> dict[str, Any]:
    """``trainer_state.json`` of a complete, intact ``step_dir`` saved with ``num_chunks`` chunks per rank."""
    missing = missing_parts(step_dir) if step_dir.is_dir() else ["the directory itself"]
    if missing:
        raise CheckpointError(f"cannot load checkpoint {step_dir}: incomplete (missing: {', '.join(missing)})")
    problem = checkpoint_problem(step_dir)
    if problem is not None:
        raise CheckpointIntegrityError(f"cannot load checkpoint {step_dir}: damaged: {problem}")
    _warn_if_no_manifest(step_dir)
    state = json.loads((step_dir / STATE_FILE).read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{step_dir / STATE_FILE}: format_version {state.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if state["num_model_chunks"] != num_chunks:
        raise CheckpointError(
            f"{step_dir} holds {state['num_model_chunks']} model chunk(s) per rank (virtual pipeline stages) but "
            f"{num_chunks} were given; loading across a virtual-pipeline change is not supported"
        )
    return state


def _check_lora_kind(step_dir: Path, state: dict, model_has_adapters: bool) -> None:
    """A LoRA checkpoint (adapters only) loads into a model with adapters, a full one into a model without."""
    saved_adapters = bool(state.get("adapters_only"))
    if saved_adapters and not model_has_adapters:
        raise CheckpointError(
            f"{step_dir} holds LoRA adapters only (trainer_state.json 'lora': {state.get('lora')}); load it with "
            "actor.lora as saved and checkpoint.load_dir = its base, or export it merged (megatron-dapo export "
            "--lora merged)"
        )
    if model_has_adapters and not saved_adapters:
        raise CheckpointError(
            f"{step_dir} holds a full model, but this run has actor.lora on (it saves and loads adapters only); "
            "start a LoRA run from it with checkpoint.load_dir (the base) instead of resuming"
        )


def _check_optimizer_fits(step_dir: Path, state: dict, optimizer) -> None:
    """The saved optimizer state can be restored into ``optimizer`` under this run's layout."""
    saved_layout, layout = state["layout"], parallel_layout()
    if state["distributed_optimizer"] and _uses_distributed_optimizer(optimizer):
        sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        changed = [f"{k} {saved_layout[k]} -> {layout[k]}" for k in sizes if saved_layout[k] != layout[k]]
        # Expert sizes are recorded only when not the defaults (EP 1, ETP = TP, which the TP check covers).
        for key, default in (("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", None)):
            if key in saved_layout or key in layout:
                saved = saved_layout.get(key, default or saved_layout["tensor_model_parallel_size"])
                now = layout.get(key, default or layout["tensor_model_parallel_size"])
                if saved != now:
                    changed.append(f"{key} {saved} -> {now}")
        if changed:
            raise CheckpointError(
                f"{step_dir}: the distributed optimizer's state ({DIST_OPTIM_FORMAT}) reshards only across data "
                f"parallelism, but {', '.join(changed)}; "
                "resume with the saved TP/PP/EP/ETP or load weights only (load_optimizer=False)"
            )
    if state["distributed_optimizer"] != _uses_distributed_optimizer(optimizer):
        raise CheckpointError(
            f"{step_dir}: saved with use_distributed_optimizer={state['distributed_optimizer']} but this run has "
            f"{not state['distributed_optimizer']}; the optimizer state formats differ (load_optimizer=False "
            "loads the weights only)"
        )


def _load_model_and_optimizer(step_dir: Path, state: dict, model_chunks: list, optimizer, restore: bool) -> None:
    """The dist checkpoint into the model chunks, and into ``optimizer`` when ``restore``. Collective."""
    from megatron.core import dist_checkpointing  # heavy: megatron-core, once the platform has patched it

    if restore:
        _prime_torch_adams(optimizer)
    sharded = _sharded_state_dict(model_chunks, optimizer if restore else None, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(step_dir / DIST_DIR))
    adapters_only = lora_modules_present(model_chunks)
    for i, chunk in enumerate(model_chunks):
        result = unwrap(chunk).load_state_dict(loaded[model_state_key(i, len(model_chunks))], strict=not adapters_only)
        if adapters_only and (result.unexpected_keys or any(is_adapter_param(k) for k in result.missing_keys)):
            raise CheckpointError(f"{step_dir}: adapter keys do not match the model's: {result}")
    if restore:
        # megatron-core copies into views of leaf parameters (fp32 + distributed optimizer): needs no_grad.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_torch_adam_steps(optimizer, state["torch_adam_steps"])
    elif optimizer is not None:
        # Main (fp32) params were copied from the model when the optimizer was built: refresh them.
        optimizer.reload_model_params()
        if rank() == 0:
            log.warning("checkpoint %s: optimizer state not restored (saved: %s)", step_dir, state["has_optimizer"])


def _restore_rng(step_dir: Path, saved_layout: dict) -> bool:
    """This rank's generators, when the parallel layout is the one they were saved under."""
    layout = parallel_layout()
    if saved_layout == layout:
        payload = torch.load(step_dir / RNG_DIR / _rng_name(rank()), weights_only=False)
        get_platform().set_rng_state(payload["state"])
        return True
    if rank() == 0:
        log.warning(
            "checkpoint %s: RNG states not restored, parallel layout changed %s -> %s", step_dir, saved_layout, layout
        )
    return False
