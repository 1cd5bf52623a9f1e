"""Loading any checkpoint a user has into this rank's model chunks, and the save-directory helpers.

``load_mcore_checkpoint(chunks, arch, load_dir)`` (the trainer's ``checkpoint.load_dir``) accepts what
``megatron_dapo.weights.dist_format.find_checkpoint`` recognises and logs what it found:

* a Megatron distributed checkpoint at any TP/PP/VPP layout — a run directory with
  ``latest_checkpointed_iteration.txt``, an ``iter_*``/``release`` directory, a bare ``dist_checkpointing``
  directory, or one of our training ``global_step_<n>`` directories: megatron-core's ``dist_checkpointing.load``
  reads each rank's slices (collective);
* an HF directory (``config.json`` + safetensors): each rank reads only the HF tensors its parameters are made of
  and keeps its slice, through the family name map and ``megatron_dapo.weights.layout``.

Files listed in a checkpoint's ``manifest.json`` are verified (sizes, CRC-32s; the ranks split the reads) before
anything is loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.weights.dist_format import CheckpointError, CheckpointSource, find_checkpoint, load_model_chunks
from megatron_dapo.weights.integrity import read_manifest, verify_files
from megatron_dapo.weights.layout import hf_to_mcore, tp_shard

log = logging.getLogger("megatron_dapo.checkpoint")

PathLike = Union[str, Path]

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Files of an HF model directory that are weights (not copied into hf_config/).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


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


# ------------------------------------------------------------------------------------------------ loading


def checkpoint_arch(source: CheckpointSource) -> Optional[ModelArch]:
    """The architecture the checkpoint's own HF config describes (None when it carries none)."""
    cfg = source.hf_config_dir
    return None if cfg is None else model_arch_from_hf(cfg)


def verify_manifest(root: PathLike) -> None:
    """Check ``<root>/manifest.json``'s files (sizes everywhere, CRC-32s split across ranks); every rank raises the
    same ``CheckpointError`` when one is damaged. Collective when torch.distributed is initialized."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problem: Optional[str] = None
    try:
        records = read_manifest(root)
        if records is not None:
            ordered = [records[k] for k in sorted(records)]
            found = verify_files(root, ordered, checksum=False) or verify_files(root, ordered[rank::world])
            problem = None if found is None else str(found)
    except ValueError as e:
        problem = str(e)
    if distributed:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, problem)
        problem = next((p for p in everyone if p), None)
    if problem is not None:
        raise CheckpointError(f"checkpoint {root} is damaged: {problem}")


@torch.no_grad()
def load_hf_into_chunks(chunks: Sequence, arch: ModelArch, hf_dir: PathLike) -> list[str]:
    """Fill this rank's chunks from an HF directory; returns the HF tensor names this rank read. Not collective."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.weights.model_io import local_param_table
    from megatron_dapo.weights.safetensors_io import SafetensorsDir

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    read: list[str] = []
    with SafetensorsDir(hf_dir) as reader:
        missing = sorted(
            {n for lp in local_param_table(list(chunks), arch) for n in lp.mapping.hf} - set(reader.keys())
        )
        if missing:
            raise CheckpointError(f"{hf_dir}: HF tensors this model needs are missing: {missing[:20]}")
        for lp in local_param_table(list(chunks), arch):
            tensors = [reader.get(n) for n in lp.mapping.hf]
            read += lp.mapping.hf
            padded = lp.param.shape[0] * tp if lp.mapping.kind == "vocab" else 0
            full = hf_to_mcore(lp.mapping, tensors, arch, padded)
            shard = tp_shard(full, lp.mapping.kind, lp.mapping.tp_dim, tp, tp_rank)
            if tuple(shard.shape) != tuple(lp.param.shape):
                raise CheckpointError(
                    f"{hf_dir}: {lp.mapping.hf} give shape {tuple(shard.shape)} for {lp.local_name!r}, expected"
                    f" {tuple(lp.param.shape)}"
                )
            lp.param.copy_(shard)
    return read


def load_mcore_checkpoint(chunks: list, arch: ModelArch, load_dir: PathLike) -> dict[str, Any]:
    """Fill this rank's model ``chunks`` from whatever ``load_dir`` is (see the module docstring). Collective for a
    Megatron checkpoint (every rank calls it, in the same order).

    Returns ``{"kind": "megatron" | "hf", "path": what was read, "description": ..., "common": the checkpoint's
    common state (Megatron) or {}}``.
    """
    source = find_checkpoint(load_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        log.info("checkpoint.load_dir %s: found %s", load_dir, source.description)
    if source.kind == "hf":
        diffs = arch_mismatches(model_arch_from_hf(source.path), arch)
        if diffs:
            raise CheckpointError(
                f"{load_dir}: config.json describes another model than this run's: {'; '.join(diffs)}"
            )
        load_hf_into_chunks(chunks, arch, source.path)
        return {"kind": "hf", "path": str(source.path), "description": source.description, "common": {}}
    stored = checkpoint_arch(source)
    if stored is not None:
        diffs = arch_mismatches(stored, arch)
        if diffs:
            raise CheckpointError(
                f"{load_dir}: its {source.hf_config_dir}/config.json describes another model than this run's:"
                f" {'; '.join(diffs)}"
            )
    verify_manifest(source.root)
    common = load_model_chunks(chunks, source.path)
    return {"kind": "megatron", "path": str(source.path), "description": source.description, "common": common}
