"""The one Megatron checkpoint format of the project: megatron-core's ``dist_checkpointing`` (torch_dist backend).

A converted (model-only) checkpoint is laid out as Megatron-LM's ``save_checkpoint`` lays it out::

    <dir>/latest_checkpointed_iteration.txt   "release" (or the iteration number)
    <dir>/release/                            a dist_checkpointing directory:
        .metadata                             torch DCP metadata (every tensor's global shape, dtype, chunks)
        __0_0.distcp                          tensor data
        common.pt                             the non-tensor part: checkpoint_version 3.0, iteration
        metadata.json                         megatron-core's backend description (torch_dist)
    <dir>/hf_config/                          config.json + tokenizer files of the source model
    <dir>/manifest.json                       size + CRC-32 of every file (``megatron_dapo/weights/integrity.py``)

Tensor keys are those of megatron-core's ``GPTModel.sharded_state_dict()`` with the TransformerEngine spec, layer-
stacked as megatron-core stores homogeneous layers (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``
of shape ``[num_layers, hidden]``; per-layer keys ``decoder.layers.{i}.…`` are read too): megatron-core's local
spec maps its own names to these on save and load, and ``megatron_dapo.models.families.to_te_name`` is our one copy
of that map. Tensors are stored whole (global shapes, the vocabulary padded to ``make_vocab_size_divisible_by``), so the
layout is chosen when loading: ``dist_checkpointing`` reads every rank's slice, and the vocabulary rows beyond the
checkpoint's padding are zero (megatron-core's ``allow_shape_mismatch`` for the embedding and output layer).

This module holds the shared pieces: the state-dict layout (``model``/``model0..``, ``checkpoint_version``,
``iteration``), the streaming single-process writer (a torch DCP planner that plans from shapes alone and produces
each tensor only when it is written), a single-process tensor reader, loading into live model chunks, and
``find_checkpoint``, which says what a directory is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.weights.integrity import (
    FileRecord,
    HashingWriter,
    NonFiniteTensorError,
    count_non_finite,
    file_crc32,
    first_non_finite,
)

log = logging.getLogger("megatron_dapo.checkpoint")

PathLike = Union[str, Path]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
HF_CONFIG_SUBDIR = "hf_config"
CHECKPOINT_VERSION = 3.0
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
MCORE_METADATA_FILE = "metadata.json"
DATA_FILE = "__0_0.distcp"
# What megatron-core writes to metadata.json for its torch_dist backend (CheckpointingConfig).
MCORE_BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# Our training step directories (``megatron_dapo/training/checkpoint.py``): the dist checkpoint sits in this subdir.
TRAINING_DIST_SUBDIR = "dist_ckpt"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, not one we read, or does not match the model; the message says what was
    found and what was expected."""


def iteration_dir_name(iteration: Optional[int]) -> str:
    """Megatron-LM's directory for an iteration: ``iter_0000100``; ``release`` for None."""
    return RELEASE_DIR if iteration is None else f"iter_{iteration:07d}"


def model_state_key(index: int, num_chunks: int) -> str:
    """Megatron-LM's ``generate_state_dict``: ``model`` for one chunk, ``model0``, ``model1``... with virtual stages."""
    return "model" if num_chunks == 1 else f"model{index}"


def model_sharded_state_dict(chunks: Sequence, metadata: Optional[dict] = None) -> dict[str, Any]:
    """The model part of a Megatron-LM state dict: each (unwrapped) chunk's ``sharded_state_dict(metadata=...)``
    (``metadata`` None: megatron-core's default, layer-stacked keys)."""
    from megatron_dapo.models.builder import unwrap

    return {
        model_state_key(i, len(chunks)): unwrap(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(chunks)
    }


def common_state(iteration: int) -> dict[str, Any]:
    """The non-tensor entries Megatron-LM's ``save_checkpoint`` writes for a model-only checkpoint (no ``args``:
    there is no Megatron-LM argument namespace here; Megatron-LM loads a checkpoint without one)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration)}


def allow_megatron_lm_common_state() -> None:
    """Let ``torch.load(weights_only=True)`` (megatron-core's ``load_common``) read Megatron-LM's ``common.pt``,
    whose ``args`` is an ``argparse.Namespace`` holding megatron-core enums (as Megatron-LM itself allows them)."""
    import enum

    import megatron.core.transformer.enums as mcore_enums

    safe: list = [argparse.Namespace]
    safe += [v for v in vars(mcore_enums).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    torch.serialization.add_safe_globals(safe)


# ------------------------------------------------------------------------------------------- what is it


@dataclass(frozen=True)
class CheckpointSource:
    """What ``find_checkpoint`` found: ``kind`` "megatron" (``path`` is the dist_checkpointing directory) or "hf"
    (``path`` is the HF directory). ``root`` holds ``manifest.json``/``hf_config`` when the checkpoint has them."""

    kind: str
    path: Path
    root: Path
    description: str

    @property
    def hf_config_dir(self) -> Optional[Path]:
        if self.kind == "hf":
            return self.path
        for d in (self.root / HF_CONFIG_SUBDIR, self.path / HF_CONFIG_SUBDIR):
            if (d / "config.json").is_file():
                return d
        return None


def is_dist_checkpoint_dir(path: PathLike) -> bool:
    path = Path(path)
    return (path / MCORE_METADATA_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def _describe(path: Path, limit: int = 12) -> str:
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "it is empty"
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return "it contains: " + ", ".join(names[:limit]) + more


WHAT_WORKS = (
    "(1) a Megatron distributed checkpoint: a directory with latest_checkpointed_iteration.txt (Megatron-LM, "
    "Megatron-Bridge, `megatron-dapo convert hf-to-mcore`), an iter_<n>/ or release/ directory in one, or a bare "
    "dist_checkpointing directory (metadata.json + .metadata); (2) a training checkpoint: a global_step_<n>/ "
    "directory or the save_dir holding them (its 'latest' marker); (3) an HF model directory (config.json + "
    "*.safetensors)"
)


def find_checkpoint(path: PathLike) -> CheckpointSource:
    """Say what ``path`` is, or raise ``CheckpointError`` naming what was found and the three things that work."""
    path = Path(path).absolute()
    if (path / TRACKER_FILE).is_file():
        text = (path / TRACKER_FILE).read_text().strip()
        if text == RELEASE_DIR:
            sub = RELEASE_DIR
        elif text.isdigit():
            sub = iteration_dir_name(int(text))
        else:
            raise CheckpointError(f"{path / TRACKER_FILE}: holds {text!r}; expected 'release' or an iteration number")
        if not is_dist_checkpoint_dir(path / sub):
            raise CheckpointError(
                f"{path / TRACKER_FILE} names {sub!r}, but {path / sub} is not a dist_checkpointing directory "
                f"({MCORE_METADATA_FILE} + {DCP_METADATA_FILE}): {_describe(path / sub)}"
            )
        return CheckpointSource("megatron", path / sub, path, f"Megatron distributed checkpoint {path} ({sub})")
    if is_dist_checkpoint_dir(path):
        parent = path.parent
        if (parent / TRACKER_FILE).is_file() or path.name.startswith("iter_") or path.name == RELEASE_DIR:
            return CheckpointSource("megatron", path, parent, f"Megatron distributed checkpoint {path}")
        return CheckpointSource("megatron", path, path, f"dist_checkpointing directory {path}")
    if is_dist_checkpoint_dir(path / TRAINING_DIST_SUBDIR):
        return CheckpointSource("megatron", path / TRAINING_DIST_SUBDIR, path, f"training checkpoint {path}")
    if (path / "latest").is_file():
        step = path / (path / "latest").read_text().strip()
        if is_dist_checkpoint_dir(step / TRAINING_DIST_SUBDIR):
            return CheckpointSource("megatron", step / TRAINING_DIST_SUBDIR, step, f"training checkpoint {step}")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return CheckpointSource("hf", path, path, f"HF model directory {path}")
    raise CheckpointError(f"{path} is not a checkpoint this project reads: {_describe(path)}. Expected {WHAT_WORKS}")


# ------------------------------------------------------------------------------------------- writing


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
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix, _write_item

    class _HashingFileSystemWriter(FileSystemWriter):
        """One data file, tensors written in plan order, hashed (CRC-32) as they are written."""

        def write_data(self, plan, planner) -> torch.futures.Future:
            prefix: _StoragePrefix = plan.storage_data
            name = f"{prefix.prefix}0.distcp"
            results = []
            from torch.utils.serialization import config as serialization_config

            zip_crc = serialization_config.save.compute_crc32
            # torch.save's own per-record CRC is a second pass over every byte; the manifest's CRC-32 (computed
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
            records.append(FileRecord(str(directory / name), stream.size, stream.crc))
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(results)
            return fut

    return _HashingFileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=True)


def write_model_checkpoint(directory: PathLike, pieces: Sequence[TensorPlan], iteration: int = 0) -> list[FileRecord]:
    """Write a dist_checkpointing directory holding ``pieces`` (unsharded by TP) from one process.

    Nothing is held beyond the piece being written: the plan is made from shapes and dtypes, and each piece is
    produced (``TensorPlan.produce``) right before it is written. Needs no torch.distributed. Returns the records
    (absolute path, size, CRC-32) of the files written.
    """
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
    with open(directory / COMMON_FILE, "wb") as raw:
        stream = HashingWriter(raw)
        torch.save(common_state(iteration), stream)
    records.append(FileRecord(str(directory / COMMON_FILE), stream.size, stream.crc))
    text = json.dumps(MCORE_BACKEND).encode()
    (directory / MCORE_METADATA_FILE).write_bytes(text)
    records.append(FileRecord(str(directory / MCORE_METADATA_FILE), len(text), zlib.crc32(text)))
    size, crc = file_crc32(directory / DCP_METADATA_FILE)  # pickled by torch DCP itself, small
    records.append(FileRecord(str(directory / DCP_METADATA_FILE), size, crc))
    return records


# ------------------------------------------------------------------------------------------- reading


class DistCheckpointReader:
    """Whole tensors of a dist_checkpointing directory, one at a time, in one process (any saved TP/PP layout)."""

    def __init__(self, directory: PathLike) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        if not is_dist_checkpoint_dir(self.directory):
            raise CheckpointError(
                f"{self.directory} is not a dist_checkpointing directory (expected {MCORE_METADATA_FILE} and "
                f"{DCP_METADATA_FILE}): {_describe(self.directory)}"
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


def stacked_layer_key(name: str) -> tuple[str, Optional[int]]:
    """``decoder.layers.{i}.x`` → (``decoder.layers.x``, i): megatron-core's key for homogeneous layers, which
    stacks every layer's tensor along a leading axis. Other names → (name, None)."""
    m = _LAYER_RE.match(name)
    return (f"decoder.layers.{m.group(2)}", int(m.group(1))) if m else (name, None)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def has_per_layer_keys(keys: Sequence[str]) -> bool:
    """Whether a checkpoint keeps one tensor per layer (``decoder.layers.{i}.x``: megatron-core with
    ``non_homogeneous_layers``) rather than layer-stacked tensors."""
    return any(_LAYER_RE.match(k) for k in keys)


# ------------------------------------------------------------------------------------- live model chunks


def _drop_missing_extra_state(sharded: dict, stored: set[str]) -> set[str]:
    """Remove ``_extra_state`` objects the checkpoint lacks from ``sharded`` (in place); their state-dict names."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dropped: set[str] = set()

    def walk(tree: dict) -> None:
        for name in list(tree):
            value = tree[name]
            if isinstance(value, dict):
                walk(value)
            elif isinstance(value, ShardedObject) and "_extra_state" in value.key and value.unique_key not in stored:
                del tree[name]
                dropped.add(name)

    for top in sharded.values():
        walk(top)
    return dropped


@torch.no_grad()
def load_model_chunks(chunks: Sequence, directory: PathLike) -> dict[str, Any]:
    """Fill model ``chunks`` (this rank's, any TP/PP/VPP) from dist_checkpointing ``directory``. Collective.

    The vocabulary rows beyond the checkpoint's padding are zero. Returns the checkpoint's common state
    (``iteration``, ``checkpoint_version``, ``args`` when Megatron-LM wrote it).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from megatron_dapo.models.builder import unwrap

    allow_megatron_lm_common_state()
    reader = DistCheckpointReader(directory)
    per_layer = has_per_layer_keys(reader.keys())
    sharded = model_sharded_state_dict(chunks, {"non_homogeneous_layers": True} if per_layer else None)
    # Module extra state (TransformerEngine's FP8 metadata; empty for the local spec) is not weights: a checkpoint
    # written without it (a converter's) or by another spec loads without it.
    skipped = _drop_missing_extra_state(sharded, reader.all_keys)
    try:
        loaded = dist_checkpointing.load(sharded, str(directory))
    except CheckpointingException as e:
        raise CheckpointError(f"{directory}: does not fit this model: {e}") from e
    for i, chunk in enumerate(chunks):
        key = model_state_key(i, len(chunks))
        result = unwrap(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if k not in skipped]
        if missing or result.unexpected_keys:
            raise CheckpointError(
                f"{directory}: model chunk {i} state does not match: missing {missing}, unexpected"
                f" {result.unexpected_keys}"
            )
    return {k: v for k, v in loaded.items() if not k.startswith("model")}


def hf_config_dir_of(load_dir: PathLike) -> Path:
    """The HF config (+ tokenizer) directory that goes with ``load_dir``: an HF directory itself, or a Megatron
    checkpoint's ``hf_config/``; ``CheckpointError`` when it carries none."""
    source = find_checkpoint(load_dir)
    found = source.hf_config_dir
    if found is None:
        raise CheckpointError(
            f"{source.description} carries no {HF_CONFIG_SUBDIR}/config.json (Megatron-LM and Megatron-Bridge "
            "checkpoints do not): set model.hf_config_dir to the HF model directory it was made from"
        )
    return found
