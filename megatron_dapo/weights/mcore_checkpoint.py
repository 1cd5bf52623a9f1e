"""Our Megatron checkpoint format: one safetensors file per (TP rank, PP stage), plus a JSON description.

Layout of a checkpoint directory::

    mcore_meta.json                    format version, family, the HF config, tp, pp, dtype, vocabulary padding
    mp_rank_{tp:02d}_{pp:03d}/model.safetensors
                                       exactly that rank's GPTModel parameters, TP-sharded as in the model
    hf_config/                         config.json + tokenizer files of the source model
    manifest.json                      size + CRC-32 of every rank file (``megatron_dapo/weights/integrity.py``),
                                       computed while writing; checked on load (sizes of all files when opened,
                                       the checksum of a rank file before its data is first read)

Tensor names are megatron-core local-spec names with GLOBAL decoder layer indices (``decoder.layers.{i}.``), so a
loader at any pipeline layout (virtual stages included) finds a layer by its global index. With tied embeddings and
PP > 1 the last stage also stores ``output_layer.weight`` (a copy of the embedding), as the model holds one there.

``load_mcore_checkpoint`` reads only this rank's file when the checkpoint's layout equals the running one, and
otherwise reshards on load: for each local parameter it reads the old TP shards of that tensor (one tensor at a
time), merges them, re-pads the vocabulary for the new TP size and keeps its own slice — all through
``megatron_dapo.weights.layout``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.models.families import ModelArch, ParamMapping, from_te_name, model_arch_from_hf
from megatron_dapo.weights.integrity import FileRecord, read_manifest, verify_file, write_manifest
from megatron_dapo.weights.layout import (
    layer_of,
    local_to_global_name,
    pad_vocab,
    pp_layer_range,
    tp_merge,
    tp_shard,
    unpad_vocab,
)
from megatron_dapo.weights.safetensors_io import (
    SafetensorsFile,
    StreamingSafetensorsWriter,
    TensorInfo,
    TensorSpec,
    read_header,
)

PathLike = Union[str, Path]

FORMAT_NAME = "megatron-dapo-mcore"
FORMAT_VERSION = 1
META_NAME = "mcore_meta.json"
MODEL_FILE = "model.safetensors"
HF_CONFIG_SUBDIR = "hf_config"
OUTPUT_LAYER = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Files of an HF model directory that are weights (not copied into hf_config/).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match the model; the message says what was expected."""


def rank_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def rank_file(directory: PathLike, tp_rank: int, pp_rank: int) -> Path:
    return Path(directory) / rank_dir_name(tp_rank, pp_rank) / MODEL_FILE


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def stage_of(name: str, arch: ModelArch, pp_size: int) -> int:
    """The (non-virtual) pipeline stage that holds global Megatron parameter ``name``."""
    layer = layer_of(name)
    if layer is not None:
        for stage in range(pp_size):
            if layer in pp_layer_range(arch.num_layers, pp_size, stage):
                return stage
        raise CheckpointError(f"{name}: layer {layer} is outside the model's {arch.num_layers} layers")
    if name == EMBEDDING:
        return 0
    if name in ("decoder.final_layernorm.weight", OUTPUT_LAYER):
        return pp_size - 1
    raise CheckpointError(f"{name}: not a decoder-layer, embedding, final-norm or output-layer parameter")


def stage_names(
    mappings: Sequence[ParamMapping], arch: ModelArch, pp_size: int
) -> list[list[tuple[str, ParamMapping]]]:
    """Per stage, the ``(stored name, mapping)`` pairs it stores, in mapping order (tied output copy included)."""
    out: list[list[tuple[str, ParamMapping]]] = [[] for _ in range(pp_size)]
    for m in mappings:
        out[stage_of(m.mcore, arch, pp_size)].append((m.mcore, m))
        if m.mcore == EMBEDDING and arch.tie_word_embeddings and pp_size > 1:
            out[pp_size - 1].append((OUTPUT_LAYER, m))
    return out


def arch_mismatches(a: ModelArch, b: ModelArch) -> list[str]:
    """Architecture fields that differ (what decides tensor names and shapes)."""
    fields = (
        "vocab_size",
        "hidden_size",
        "ffn_hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "head_dim",
        "tie_word_embeddings",
        "qkv_bias",
        "qk_layernorm",
    )
    out = [f"family: {a.family.name} vs {b.family.name}"] if a.family.name != b.family.name else []
    out += [f"{f}: {getattr(a, f)} vs {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    return out


# --------------------------------------------------------------------------------------- save directories


def describe_dir(path: Path, limit: int = 10) -> str:
    names = sorted(p.name for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def prepare_save_dir(save_dir: PathLike, overwrite: bool, inputs: Sequence[PathLike] = ()) -> Path:
    """Check ``save_dir`` and create the temporary directory we write into (renamed by ``finalize_save_dir``).

    Nothing already in ``save_dir`` is touched until the new checkpoint is complete.
    """
    save_dir = Path(save_dir).absolute()
    for src in inputs:
        if src is not None and Path(src).exists() and save_dir.exists() and Path(src).resolve() == save_dir.resolve():
            raise CheckpointError(f"save directory {save_dir} is the input directory; choose another save directory")
    if save_dir.exists():
        if not save_dir.is_dir():
            raise CheckpointError(f"save directory {save_dir} exists and is not a directory")
        if any(save_dir.iterdir()) and not overwrite:
            raise CheckpointError(
                f"save directory {save_dir} already exists and is not empty (contains: {describe_dir(save_dir)});"
                " pass --overwrite (overwrite=True) to replace it"
            )
    tmp = save_dir.parent / f"{save_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of this very pid: ours
    tmp.mkdir(parents=True)
    return tmp


def finalize_save_dir(tmp: Path, save_dir: PathLike) -> Path:
    """Move the finished ``tmp`` into place; an existing ``save_dir`` is removed only after that succeeded."""
    save_dir = Path(save_dir).absolute()
    old = None
    if save_dir.exists():
        old = save_dir.parent / f"{save_dir.name}.old-{os.getpid()}"
        os.rename(save_dir, old)
    os.rename(tmp, save_dir)
    if old is not None:
        shutil.rmtree(old)
    return save_dir


def copy_hf_side_files(src_dir: PathLike, dst_dir: PathLike) -> list[str]:
    """Copy config.json, generation config and tokenizer files (everything but weights) from an HF directory."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src_dir.iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_INDEXES:
            continue
        shutil.copyfile(p, dst_dir / p.name)
        copied.append(p.name)
    return copied


def write_meta(directory: PathLike, meta: dict) -> None:
    with open(Path(directory) / META_NAME, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def make_meta(
    arch: ModelArch,
    tp: int,
    pp: int,
    dtype: str,
    padded_vocab: int,
    make_vocab_size_divisible_by: int,
    vpp: Optional[int] = None,
) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "family": arch.family.name,
        "hf_config": arch.hf_config,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "dtype": dtype,
        "vocab_size": arch.vocab_size,
        "padded_vocab_size": padded_vocab,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
        "num_layers": arch.num_layers,
    }


# ------------------------------------------------------------------------------------------------ reading


class McoreCheckpoint:
    """Read access to a checkpoint directory: tensor by tensor, by stored name and TP rank."""

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory).absolute()
        meta_path = self.directory / META_NAME
        if not meta_path.is_file():
            found = describe_dir(self.directory) if self.directory.is_dir() else "directory does not exist"
            raise CheckpointError(
                f"{self.directory} is not a megatron-dapo Megatron checkpoint: {META_NAME} is missing (found: {found});"
                " make one with `convert.py hf-to-mcore`"
            )
        with open(meta_path) as f:
            self.meta: dict[str, Any] = json.load(f)
        if self.meta.get("format") != FORMAT_NAME or self.meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{meta_path}: format {self.meta.get('format')!r} version {self.meta.get('format_version')!r};"
                f" expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
            )
        self.arch = model_arch_from_hf(self.meta["hf_config"])
        self.tp = int(self.meta["tensor_model_parallel_size"])
        self.pp = int(self.meta["pipeline_model_parallel_size"])
        self.padded_vocab = int(self.meta["padded_vocab_size"])
        self._files: dict[tuple[int, int], SafetensorsFile] = {}
        try:
            self._manifest = read_manifest(self.directory)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        for record in (self._manifest or {}).values():
            if (self.directory / record.path).exists():  # a missing rank file gets the layout message in _path
                self._verify(record, checksum=False)
        # Which stage file holds each name: from the TP-rank-0 headers (cheap: no tensor data is read).
        self._stage: dict[str, int] = {}
        for pp_rank in range(self.pp):
            for name in self._header(0, pp_rank):
                self._stage[name] = pp_rank

    def _path(self, tp_rank: int, pp_rank: int) -> Path:
        path = rank_file(self.directory, tp_rank, pp_rank)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: a TP={self.tp} PP={self.pp} checkpoint needs"
                f" {rank_dir_name(0, 0)}/{MODEL_FILE} .. {rank_dir_name(self.tp - 1, self.pp - 1)}/{MODEL_FILE}"
            )
        return path

    def _header(self, tp_rank: int, pp_rank: int) -> dict[str, TensorInfo]:
        if (tp_rank, pp_rank) in self._files:
            return self._files[(tp_rank, pp_rank)].tensors
        return read_header(self._path(tp_rank, pp_rank))[0]

    def _verify(self, record: FileRecord, checksum: bool) -> None:
        problem = verify_file(self.directory, record, checksum=checksum)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.directory} is damaged: {problem}")

    def file(self, tp_rank: int, pp_rank: int) -> SafetensorsFile:
        key = (tp_rank, pp_rank)
        if key not in self._files:
            path = self._path(tp_rank, pp_rank)
            record = (self._manifest or {}).get(path.relative_to(self.directory).as_posix())
            if record is not None:
                self._verify(record, checksum=True)  # before any of its data is used
            self._files[key] = SafetensorsFile(path)
        return self._files[key]

    def names(self) -> list[str]:
        return list(self._stage)

    def opened_files(self) -> list[Path]:
        """The rank files opened so far (for a tensor header or data; the index at start-up reads TP-0 headers only)."""
        return sorted(f.path for f in self._files.values())

    def __contains__(self, name: str) -> bool:
        return name in self._stage

    def stage(self, name: str) -> int:
        if name not in self._stage:
            raise CheckpointError(
                f"{self.directory}: no tensor {name!r} in any stage file (it holds {len(self._stage)} tensors, e.g."
                f" {sorted(self._stage)[:8]})"
            )
        return self._stage[name]

    def info(self, name: str, tp_rank: int) -> TensorInfo:
        f = self.file(tp_rank, self.stage(name))
        if name not in f.tensors:
            raise CheckpointError(f"{f.path}: tensor {name!r} is missing (the TP rank 0 file of the stage has it)")
        return f.tensors[name]

    def shard(self, name: str, tp_rank: int) -> torch.Tensor:
        self.info(name, tp_rank)
        return self.file(tp_rank, self.stage(name)).get(name)

    def full(self, name: str, mapping: ParamMapping) -> torch.Tensor:
        """The full (TP=1) tensor: the TP shards merged through the layout module (still vocab-padded)."""
        if mapping.tp_dim is None:
            return self.shard(name, 0)
        return tp_merge([self.shard(name, r) for r in range(self.tp)], mapping.kind, mapping.tp_dim)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> McoreCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------- live model: load/save


def _global_name(local_name: str, offset: int) -> str:
    return local_to_global_name(from_te_name(local_name), offset)


def _layout() -> tuple[int, int, int, int, Optional[int]]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )


@torch.no_grad()
def load_mcore_checkpoint(chunks: list, arch: ModelArch, load_dir: PathLike) -> dict[str, Any]:
    """Fill this rank's model chunks from ``load_dir`` (reshards on load when the layouts differ).

    Returns a small report: ``{"same_layout": bool, "files": [the rank files this rank read]}``. Not collective:
    every rank reads what it needs, so ranks may call it at different times.
    """
    from megatron_dapo.weights.model_io import chunk_layer_offset, local_param_table

    tp, tp_rank, pp, pp_rank, vpp = _layout()
    with McoreCheckpoint(load_dir) as ckpt:
        diffs = arch_mismatches(ckpt.arch, arch)
        if diffs:
            raise CheckpointError(f"{load_dir}: checkpoint architecture differs from the model's: {'; '.join(diffs)}")
        ckpt_vpp = ckpt.meta.get("virtual_pipeline_model_parallel_size")
        same_layout = ckpt.tp == tp and ckpt.pp == pp and ckpt_vpp == vpp
        loaded: set[str] = set()
        for lp in local_param_table(chunks, arch):
            offset = chunk_layer_offset(arch, pp, pp_rank, vpp, lp.chunk)
            name = _global_name(lp.local_name, offset)
            if name not in ckpt and name == OUTPUT_LAYER and arch.tie_word_embeddings:
                name = EMBEDDING  # the old layout had PP=1: the tied output weight is the embedding itself
            param = lp.param
            old = ckpt.info(name, tp_rank if ckpt.tp == tp else 0)
            if ckpt.tp == tp and old.shape == tuple(param.shape):
                shard = ckpt.shard(name, tp_rank)  # same TP sharding: this rank's old file is its new slice
            else:
                full = ckpt.full(name, lp.mapping)
                if lp.mapping.kind == "vocab":
                    # Padding depends on TP: strip the old padding, pad to this model's size.
                    full = pad_vocab(unpad_vocab(full, arch.vocab_size), param.shape[0] * tp)
                shard = tp_shard(full, lp.mapping.kind, lp.mapping.tp_dim, tp, tp_rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{load_dir}: tensor {name!r} (TP={ckpt.tp} PP={ckpt.pp}) gives shape {tuple(shard.shape)} for"
                    f" parameter {lp.local_name!r} at TP={tp} PP={pp}, expected {tuple(param.shape)}"
                )
            param.copy_(shard)
            loaded.add(name)
        if same_layout:
            own = set(ckpt.file(tp_rank, pp_rank).tensors)
            extra = sorted(own - loaded)
            if extra:
                raise CheckpointError(
                    f"{ckpt.file(tp_rank, pp_rank).path} holds tensors this rank's model has no parameter for: {extra}"
                )
        files = [str(p) for p in ckpt.opened_files()]
    return {"same_layout": same_layout, "files": files}


def _dp_rank_zero() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


@torch.no_grad()
def save_mcore_checkpoint(
    chunks: list,
    arch: ModelArch,
    save_dir: PathLike,
    make_vocab_size_divisible_by: int = 128,
    hf_config_dir: Optional[PathLike] = None,
    overwrite: bool = False,
) -> Path:
    """Write the live model in our format at its current TP/PP layout. Collective over the default group.

    Every (TP, PP) rank of data-parallel rank 0 writes its own file (with VPP, its chunks' parameters together);
    rank 0 writes the description and moves the finished directory into place. The directory must be visible to
    all ranks (a shared file system across nodes). ``hf_config_dir`` supplies tokenizer files; without it only
    config.json (from ``arch.hf_config``) is written.
    """
    import torch.distributed as dist

    from megatron_dapo.weights.model_io import chunk_layer_offset, local_param_table

    tp, tp_rank, pp, pp_rank, vpp = _layout()
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0

    def agree(obj):
        """rank 0's value everywhere, and every rank's error (if any) raised everywhere."""
        if not distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def gather_errors(err: Optional[str]) -> list[str]:
        if not distributed:
            return [err] if err else []
        errs: list = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        return [e for e in errs if e]

    state: dict[str, Any] = {}
    if rank == 0:
        try:
            state["tmp"] = str(prepare_save_dir(save_dir, overwrite))
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            state["error"] = str(e)
    state = agree(state)
    if "error" in state:
        raise CheckpointError(state["error"])
    tmp = Path(state["tmp"])

    err = None
    dtypes: set[str] = set()
    padded = None
    record = None
    try:
        table = local_param_table(chunks, arch)
        items = []
        for lp in table:
            offset = chunk_layer_offset(arch, pp, pp_rank, vpp, lp.chunk)
            items.append((_global_name(lp.local_name, offset), lp.param))
            if lp.mapping.kind == "vocab":
                padded = lp.param.shape[0] * tp
            dtypes.add(dtype_name(lp.param.dtype))
        if _dp_rank_zero():
            path = rank_file(tmp, tp_rank, pp_rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            specs = [TensorSpec(n, p.dtype, tuple(p.shape)) for n, p in items]
            with StreamingSafetensorsWriter(path, specs, {"format": "pt"}) as w:
                for n, p in items:
                    w.write(n, p.detach())
            record = (path.relative_to(tmp).as_posix(), *w.record)
    except Exception as e:  # noqa: BLE001 - gathered so that no rank waits forever for a failed one
        err = f"rank {rank}: {type(e).__name__}: {e}"
    errors = gather_errors(err)
    infos = [(sorted(dtypes), padded, record)]
    if distributed:
        infos = [None] * dist.get_world_size()
        dist.all_gather_object(infos, (sorted(dtypes), padded, record))
    if not errors and rank == 0:
        try:
            all_dtypes = sorted({d for ds, _, _ in infos for d in ds})
            pads = {p for _, p, _ in infos if p is not None}
            write_manifest(tmp, [FileRecord(*rec) for _, _, rec in infos if rec is not None])
            meta = make_meta(
                arch,
                tp,
                pp,
                all_dtypes[0] if len(all_dtypes) == 1 else "mixed",
                pads.pop(),
                make_vocab_size_divisible_by,
                vpp,
            )
            write_meta(tmp, meta)
            hf_dst = tmp / HF_CONFIG_SUBDIR
            if hf_config_dir is not None:
                copy_hf_side_files(hf_config_dir, hf_dst)
            hf_dst.mkdir(exist_ok=True)
            with open(hf_dst / "config.json", "w") as f:
                json.dump(arch.hf_config, f, indent=2)
            finalize_save_dir(tmp, save_dir)
        except Exception as e:  # noqa: BLE001
            errors = [f"rank 0: {type(e).__name__}: {e}"]
    if errors and rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # our own partial output; the previous save_dir (if any) is untouched
    errors = agree(errors)
    if errors:
        raise CheckpointError(f"saving {save_dir} failed: {'; '.join(errors)}")
    return Path(save_dir).absolute()
