"""Loading any checkpoint a user has into this rank's live model chunks.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.models.builder import unwrap
from megatron_dapo.models.families import ModelArch, model_arch_from_hf, param_mappings
from megatron_dapo.parallel import all_gather_object, rank, world_size
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import check_hf_tensors
from megatron_dapo.weights.dist_format import (
    CheckpointSource,
    allow_megatron_lm_common_state,
    find_checkpoint,
    has_per_layer_keys,
    model_sharded_state_dict,
    model_state_key,
)
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.integrity import manifest_problem
from megatron_dapo.weights.layout import hf_to_mcore
from megatron_dapo.weights.model_io import load_full_tensors, local_param_table
from megatron_dapo.weights.safetensors_io import SafetensorsDir

log = logging.getLogger("megatron_dapo.checkpoint")

PathLike = Union[str, Path]


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
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_layers",
        "hf_prefix",  # a VLM's text model (model.language_model.) or a text-only checkpoint (model.)
        "gated_delta_net",
        "rotary_percent",
    )
    out = [f"family: {a.family.name} vs {b.family.name}"] if a.family.name != b.family.name else []
    out += [f"{f}: {getattr(a, f)} vs {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    return out


# ------------------------------------------------------------------------- Megatron dist checkpoints


def _drop_missing_extra_state(sharded: dict, stored: set[str]) -> set[str]:
    """Remove ``_extra_state`` objects the checkpoint lacks from ``sharded`` (in place); their state-dict names."""
    # heavy: megatron-core, once the platform has patched it
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
    # heavy: megatron-core, once the platform has patched it
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

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


# ------------------------------------------------------------------------------------------------ any source


def checkpoint_arch(source: CheckpointSource) -> Optional[ModelArch]:
    """The architecture the checkpoint's own HF config describes (None when it carries none)."""
    cfg = source.hf_config_dir
    return None if cfg is None else model_arch_from_hf(cfg)


def verify_manifest(root: PathLike) -> None:
    """Check ``<root>/manifest.json``'s files (sizes everywhere, CRC-32s split across ranks); every rank raises the
    same ``CheckpointError`` when one is damaged. Collective when torch.distributed is initialized."""
    problem = manifest_problem(root, checksum=True, rank=rank(), world=world_size())
    problem = next((p for p in all_gather_object(problem) if p), None)
    if problem is not None:
        raise CheckpointError(f"checkpoint {root} is damaged: {problem}")


@torch.no_grad()
def load_hf_into_chunks(chunks: Sequence, arch: ModelArch, hf_dir: PathLike) -> list[str]:
    """Fill this rank's chunks from an HF directory; returns the HF tensor names this rank read. Not collective."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    tp = ps.get_tensor_model_parallel_world_size()
    read: list[str] = []
    with SafetensorsDir(hf_dir) as reader:
        # The converter's check, on the whole model (headers only), so that every rank stops with the same message
        # naming each missing or misshapen tensor and its file. Tensors no mapping reads (other heads, extra
        # modules) are left alone, as before.
        check_hf_tensors(reader, arch, param_mappings(arch), unexpected_ok=True)
        table = local_param_table(list(chunks), arch)
        vocab_rows = {lp.mapping.mcore: lp.param.shape[0] * tp for lp in table if lp.mapping.kind == "vocab"}

        def full_tensor(mapping):
            read.extend(mapping.hf)
            tensors = [reader.get(n) for n in mapping.hf]
            return hf_to_mcore(mapping, tensors, arch, vocab_rows.get(mapping.mcore, 0))

        load_full_tensors(list(chunks), arch, full_tensor, where=str(hf_dir))
    return read


def load_mcore_checkpoint(chunks: list, arch: ModelArch, load_dir: PathLike) -> dict[str, Any]:
    """Fill this rank's model ``chunks`` from whatever ``load_dir`` is (see the module docstring). Collective for a
    Megatron checkpoint (every rank calls it, in the same order).

    Returns ``{"kind": "megatron" | "hf", "path": what was read, "description": ..., "common": the checkpoint's
    common state (Megatron) or {}}``.
    """
    source = find_checkpoint(load_dir)
    if rank() == 0:
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
