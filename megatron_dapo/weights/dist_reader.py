"""Reading whole tensors (or one layer of a layer-stacked tensor) of a dist_checkpointing directory in one process,
whatever TP/PP layout saved it (``megatron_dapo.weights.dist_format`` describes the format)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import (
    DCP_METADATA_FILE,
    MCORE_METADATA_FILE,
    PathLike,
    describe_dir,
    is_dist_checkpoint_dir,
)


class DistCheckpointReader:
    """Whole tensors of a dist_checkpointing directory, one at a time, in one process (any saved TP/PP layout)."""

    def __init__(self, directory: PathLike) -> None:
        # heavy: torch.distributed.checkpoint (~1 s on top of torch)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        if not is_dist_checkpoint_dir(self.directory):
            raise CheckpointError(
                f"{self.directory} is not a dist_checkpointing directory (expected {MCORE_METADATA_FILE} and "
                f"{DCP_METADATA_FILE}): {describe_dir(self.directory)}"
            )
        backend = json.loads((self.directory / MCORE_METADATA_FILE).read_text())
        if backend.get("sharded_backend") != "torch_dist":
            raise CheckpointError(
                f"{self.directory / MCORE_METADATA_FILE}: sharded_backend {backend.get('sharded_backend')!r}; "
                "expected 'torch_dist' (the only backend megatron-core writes today)"
            )
        try:
            metadata = FileSystemReader(str(self.directory)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise CheckpointError(f"{self.directory / DCP_METADATA_FILE}: unreadable ({e})") from e
        self.all_keys = set(metadata.state_dict_metadata)  # tensors and objects (e.g. TransformerEngine extra state)
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            key: (md.properties.dtype, tuple(md.size))
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def read(self, requests: Sequence[tuple[str, Optional[int]]]) -> list[torch.Tensor]:
        """The tensors asked for: ``(key, None)`` a whole tensor, ``(key, i)`` index ``i`` of a layer-stacked one
        (only that layer's bytes are read); merged from every saved shard, whatever layout saved them."""
        # heavy: torch.distributed.checkpoint (~1 s on top of torch)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        missing = [k for k, _ in requests if k not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.directory}: no tensor {missing} (it holds e.g. {sorted(self.tensors)[:8]})")
        outs, chunks = {}, {}
        for i, (key, layer) in enumerate(requests):
            dtype, shape = self.tensors[key]
            offsets = [0] * len(shape)
            sizes = list(shape)
            if layer is not None:
                offsets[0], sizes[0] = layer, 1
            name = f"{i}:{key}"  # one request = one destination tensor
            outs[name] = torch.empty(sizes, dtype=dtype)
            chunks[name] = (key, ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))

        class _SliceLoadPlanner(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                items = []
                for name, (key, chunk) in chunks.items():
                    for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk]):
                        items.append(dataclasses.replace(item, dest_index=MetadataIndex(name)))
                return LoadPlan(items)

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                outs, storage_reader=FileSystemReader(str(self.directory)), planner=_SliceLoadPlanner(), no_dist=True
            )
        return [t[0] if layer is not None else t for t, (_, layer) in zip(outs.values(), requests)]
