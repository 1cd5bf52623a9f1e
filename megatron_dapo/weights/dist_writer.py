"""Writing dist_checkpointing directories (``megatron_dapo.weights.dist_format``).

The converter's writer, from one process, streaming: a torch DCP planner that plans from shapes and dtypes alone
(``TensorPlan``) and produces each tensor only when it is written, and a writer that puts every tensor into one data
file, hashed (XXH3-64) as it is written; the bookkeeping files megatron-core expects (``common.pt``,
``metadata.json``) are added. Needs no torch.distributed.

The training save's file writer (``BucketWriter``): megatron-core plans the save and hands back its write buckets
(one file each, ``FileSystemWriterAsync``'s ``(path, storage key, (byte items, tensor items))``); they are written by
threads of this process in megatron-core's own item format (torch DCP's ``_write_item``, ``torch.save`` per item),
hashed as written, one fsync per file. ``HostStaging`` snapshots the buckets' tensors into host buffers kept across
saves (pinned where the platform has DMA), so that a background write never reads state that training changes.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.serialization import config as serialization_config

from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import (
    COMMON_FILE,
    DCP_METADATA_FILE,
    MCORE_BACKEND,
    MCORE_METADATA_FILE,
    PathLike,
    common_state,
)
from megatron_dapo.weights.integrity import (
    FileRecord,
    HashingWriter,
    NonFiniteTensorError,
    count_non_finite,
    file_digest,
    first_non_finite,
    torch_save_hashed,
    write_bytes_hashed,
)


@dataclass(frozen=True)
class TensorPlan:
    """One piece of a checkpoint tensor being written: the tensor's key, dtype and global shape, where this piece
    sits in it (``offsets``; its shape is ``shape`` with a leading 1 when ``layer`` is set), and how to produce it.

    ``layer`` set: the piece is decoder layer ``layer`` of a layer-stacked tensor (megatron-core's layout for
    homogeneous layers: key ``decoder.layers.<name>``, global shape ``(num_layers, *shape)``)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the produced tensor
    produce: Callable[[], torch.Tensor]
    layer: Optional[int] = None
    num_layers: Optional[int] = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shape if self.layer is None else (int(self.num_layers),) + self.shape

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        zeros = (0,) * len(self.shape)
        return zeros if self.layer is None else (self.layer,) + zeros

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self.shape if self.layer is None else (1,) + self.shape


def _streaming_planner(pieces: Sequence[TensorPlan]):
    # heavy: torch.distributed.checkpoint (~1 s on top of torch)
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    by_index = {(p.key, p.chunk_offsets): p for p in pieces}

    class _StreamingSavePlanner(DefaultSavePlanner):
        """Plans from shapes and dtypes alone; ``resolve_data`` produces each piece when it is written."""

        def create_local_plan(self) -> SavePlan:
            items = [
                WriteItem(
                    index=MetadataIndex(p.key, torch.Size(p.chunk_offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(p.chunk_offsets), torch.Size(p.chunk_shape)),
                        properties=TensorProperties(dtype=p.dtype),
                        size=torch.Size(p.global_shape),
                    ),
                )
                for p in pieces
            ]
            self.plan = SavePlan(items, planner_data={})
            return self.plan

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.mcore_data = {}  # what megatron-core's planner adds (no reformulated tensors here)
            return plans, metadata

        def resolve_data(self, write_item):
            piece = by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
            t = piece.produce()
            if tuple(t.shape) != piece.shape or t.dtype != piece.dtype:
                raise CheckpointError(
                    f"{piece.key}: produced {tuple(t.shape)} {t.dtype}, planned {piece.shape} {piece.dtype}"
                )
            if first_non_finite([(piece.key, t)]) is not None:  # one reduction, no temporary of t's size
                where = "" if piece.layer is None else f" (layer {piece.layer})"
                raise NonFiniteTensorError(
                    f"refusing to write tensor {piece.key!r}{where}: {count_non_finite(t)} non-finite value(s)"
                )
            return t.reshape(piece.chunk_shape).contiguous()

    return _StreamingSavePlanner()


def _hashing_writer(directory: Path, records: list[FileRecord]):
    # heavy: torch.distributed.checkpoint (~1 s on top of torch)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix, _write_item

    class _HashingFileSystemWriter(FileSystemWriter):
        """One data file, tensors written in plan order, hashed (XXH3-64) as they are written."""

        def write_data(self, plan, planner) -> torch.futures.Future:
            prefix: _StoragePrefix = plan.storage_data
            name = f"{prefix.prefix}0.distcp"
            results = []
            zip_crc = serialization_config.save.compute_crc32
            # torch.save's own per-record CRC is a second pass over every byte; the manifest's checksum (computed
            # here as the bytes are written) covers the file, and torch.load does not need the zip CRC.
            serialization_config.save.compute_crc32 = False
            try:
                with open(directory / name, "wb") as raw:
                    stream = HashingWriter(raw)
                    for item in plan.items:
                        data = planner.resolve_data(item)
                        results.append(
                            _write_item(self.transforms, stream, data, item, name, self.serialization_format)
                        )
                        del data
                    raw.flush()
                    os.fsync(raw.fileno())
            finally:
                serialization_config.save.compute_crc32 = zip_crc
            records.append(stream.record(directory / name))
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(results)
            return fut

    return _HashingFileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=True)


def write_model_checkpoint(directory: PathLike, pieces: Sequence[TensorPlan], iteration: int = 0) -> list[FileRecord]:
    """Write a dist_checkpointing directory holding ``pieces`` (unsharded by TP) from one process.

    Nothing is held beyond the piece being written: the plan is made from shapes and dtypes, and each piece is
    produced (``TensorPlan.produce``) right before it is written. Needs no torch.distributed. Returns the records
    (absolute path, size, digest) of the files written.
    """
    # heavy: torch.distributed.checkpoint (~1 s on top of torch)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records: list[FileRecord] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer, planner = _hashing_writer(directory, records), _streaming_planner(pieces)
        try:
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            # torch DCP wraps what failed (a producer, the disk); raise that, with its own type and message.
            failure = next(iter(e.failures.values()), None)
            if failure is None:
                raise
            raise failure[0] from None
    records.append(torch_save_hashed(common_state(iteration), directory / COMMON_FILE))
    records.append(write_bytes_hashed(directory / MCORE_METADATA_FILE, json.dumps(MCORE_BACKEND).encode()))
    records.append(FileRecord(str(directory / DCP_METADATA_FILE), *file_digest(directory / DCP_METADATA_FILE)))
    return records


# ------------------------------------------------------------------------------ training saves: write buckets

# The disk starts on a file's bytes every this many written (``HashingWriter``): the final fsync waits for the tail.
WRITEBACK_EVERY = 64 << 20
# megatron-core's ``WriteBucket``: (file path, storage key, (byte items, tensor items)), items ``(WriteItem, data)``.
WriteBucket = tuple[str, str, tuple[list, list]]


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of exactly its bytes, without a copy (``t`` itself when it has one already).

    ``torch.save`` writes a tensor's whole storage, so megatron-core clones a CPU view into a larger storage before
    writing it (its ``_clone_if_needed``); an alias on a slice of the storage writes the same bytes with no copy.
    A non-contiguous view is returned as it is (megatron-core clones it)."""
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() == nbytes or t.device.type != "cpu" or not t.is_contiguous() or nbytes == 0:
        return t
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(storage[start : start + nbytes], 0, t.shape, t.stride())


class _ZipCrcOff:
    """``torch.save``'s per-record zip CRC-32 off while any bucket writer runs (a process-wide switch, counted).

    The manifest's checksum, computed as the bytes are written, covers every file; the zip CRC would be a second
    pass over every byte, and ``torch.load`` does not check it."""

    _lock = threading.Lock()
    _users = 0
    _saved = True

    @classmethod
    def enter(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                cls._saved = serialization_config.save.compute_crc32
                serialization_config.save.compute_crc32 = False
            cls._users += 1

    @classmethod
    def exit(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                serialization_config.save.compute_crc32 = cls._saved


def _write_item_args() -> tuple[list, dict[str, Any]]:
    """``_write_item``'s leading and keyword arguments for this torch: torch >= 2.6 takes the writer's stream
    transforms (megatron-core's writer has no extensions: no transform; the write results record what was applied)
    and the serialization format (``TORCH_SAVE``, as megatron-core writes)."""
    from torch.distributed.checkpoint import filesystem  # heavy: torch.distributed.checkpoint (~1 s on top of torch)

    params = inspect.signature(filesystem._write_item).parameters
    leading = [filesystem._StorageWriterTransforms()] if "transforms" in params else []
    extra = {}
    if "serialization_format" in params:
        extra["serialization_format"] = filesystem.SerializationFormat.TORCH_SAVE
    return leading, extra


def write_bucket(bucket: WriteBucket) -> tuple[list, FileRecord]:
    """Write one megatron-core write bucket as its file: byte items, then tensor items, each in megatron-core's
    format (``_write_item``), hashed as written, fsynced once. Returns (the write results, the file's record)."""
    from torch.distributed.checkpoint.filesystem import _write_item  # heavy: torch.distributed.checkpoint

    leading, extra = _write_item_args()
    file_name, storage_key, (bytes_data, tensor_data) = bucket
    results = []
    with open(file_name, "wb") as raw:
        stream = HashingWriter(raw, writeback_every=WRITEBACK_EVERY)
        for item, data in list(bytes_data) + list(tensor_data):
            results.append(_write_item(*leading, stream, data, item, storage_key, **extra))
        raw.flush()
        os.fsync(raw.fileno())
    return results, stream.record(file_name)


class BucketWriter:
    """Writes a save's write buckets (one file each, ``write_bucket``) with ``threads`` threads, and waits for them
    with a bound.

    Threads, not processes: the bytes are written from this process's memory (no fork of a large process, no copy
    into a child), and the work is system calls and hashing, which release the GIL. A thread cannot be killed: one
    that fails or does not finish in time is reported (``wait``) and left behind as a daemon; its file is in a
    temporary directory that is never published."""

    def __init__(self, buckets: Sequence[WriteBucket], label: str, threads: Optional[int] = None) -> None:
        self.buckets, self.label = list(buckets), label
        self.outcomes: dict[int, Any] = {}  # bucket index -> (results, record) or the error text
        n = max(1, min(threads or len(self.buckets), len(self.buckets)))
        self._threads = [threading.Thread(target=self._run, args=(k, n), daemon=True) for k in range(n)]
        self._done = threading.Semaphore(0)  # released once per bucket
        self._started_at: Optional[float] = None
        self._crc_off = False

    def _run(self, first: int, stride: int) -> None:
        for i in range(first, len(self.buckets), stride):
            try:
                self.outcomes[i] = write_bucket(self.buckets[i])
            except BaseException as e:  # noqa: BLE001 - reported by wait(), which names the file
                self.outcomes[i] = f"{type(e).__name__}: {e}"
            finally:
                self._done.release()

    def start(self) -> BucketWriter:
        _ZipCrcOff.enter()
        self._crc_off = True
        self._started_at = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def what(self, i: int) -> str:
        return f"checkpoint writer thread (writing {self.buckets[i][0]}) for {self.label}"

    def wait(self, timeout_s: float) -> tuple[dict[int, list], list[FileRecord], Optional[str]]:
        """Wait until every file is written, one failed, or ``timeout_s`` after ``start``. Returns (write results by
        bucket, the files' records, the first error or None)."""
        deadline = (self._started_at or time.monotonic()) + timeout_s
        error: Optional[str] = None
        for _ in self.buckets:
            if not self._done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                late = next((i for i in range(len(self.buckets)) if i not in self.outcomes), 0)
                error = f"{self.what(late)} did not finish within timeout_s={timeout_s:g}"
                break
            failed = next((i for i, o in sorted(self.outcomes.items()) if isinstance(o, str)), None)
            if failed is not None:
                error = f"{self.what(failed)} failed: {self.outcomes[failed]}"
                break
        if self._crc_off:
            self._crc_off = False
            _ZipCrcOff.exit()
        if error is not None:
            return {}, [], error
        order = sorted(self.outcomes)
        return {i: self.outcomes[i][0] for i in order}, [self.outcomes[i][1] for i in order], None


class HostStaging:
    """Host copies of a save's tensors, in one buffer kept from save to save (re-made when the state grows).

    ``alloc(nbytes)`` makes the buffer (``Platform.host_buffer``: pinned where the platform has DMA, so the
    device→host copy runs at bus speed and, once made, costs no page faults), ``free`` gives it back, ``synchronize``
    waits for the asynchronous copies. Each staged tensor is an exact-storage alias of its slice of the buffer
    (``exact_storage``), so ``torch.save`` writes its bytes only."""

    ALIGN = 64

    def __init__(
        self,
        alloc: Callable[[int], torch.Tensor],
        free: Callable[[torch.Tensor], None],
        synchronize: Callable[[], None],
    ) -> None:
        self.alloc, self.free, self.synchronize = alloc, free, synchronize
        self.buffer: Optional[torch.Tensor] = None

    def _offsets(self, tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        return offsets, end

    def stage(self, buckets: Sequence[WriteBucket], host_too: bool) -> list[WriteBucket]:
        """``buckets`` with their tensors copied into the buffer: device tensors always, host tensors when
        ``host_too`` (a background write: training changes them meanwhile); host tensors not copied get an
        exact-storage alias. Returns once the copies are complete."""
        moved = [t for _, _, (_, items) in buckets for _, t in items if host_too or t.device.type != "cpu"]
        offsets, total = self._offsets(moved)
        if moved and (self.buffer is None or self.buffer.numel() < total):
            self.release()
            self.buffer = self.alloc(total)
        where = {id(t): off for t, off in zip(moved, offsets)}
        staged = []
        for file_name, key, (byte_items, items) in buckets:
            out = []
            for item, t in items:
                if id(t) in where:
                    nbytes = t.numel() * t.element_size()
                    host = self.buffer[where[id(t)] : where[id(t)] + nbytes].view(t.dtype).view(t.shape)
                    host.copy_(t.detach(), non_blocking=True)
                    t = host
                out.append((item, exact_storage(t.detach())))
            staged.append((file_name, key, (byte_items, out)))
        if moved:
            self.synchronize()
        return staged

    def release(self) -> None:
        """Give the buffer back (the next ``stage`` that copies makes a new one)."""
        if self.buffer is not None:
            self.free(self.buffer)
            self.buffer = None
