"""Writing a dist_checkpointing directory (``megatron_dapo.weights.dist_format``) from one process, streaming.

A torch DCP planner that plans from shapes and dtypes alone (``TensorPlan``) and produces each tensor only when it
is written, and a writer that puts every tensor into one data file, hashed (XXH3-64) as it is written; the
bookkeeping files megatron-core expects (``common.pt``, ``metadata.json``) are added. Needs no torch.distributed.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.utils.serialization import config as serialization_config

from megatron_dapo.weights.dist_format import (
    COMMON_FILE,
    DCP_METADATA_FILE,
    MCORE_BACKEND,
    MCORE_METADATA_FILE,
    PathLike,
    common_state,
)
from megatron_dapo.weights.errors import CheckpointError
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
