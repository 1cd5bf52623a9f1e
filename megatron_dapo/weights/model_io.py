"""Moving tensors in and out of this rank's megatron-core model chunks, by global parameter name.

``local_param_table`` says which full tensors this rank needs (and which TP slice of each); loaders and the weight
sync iterate it so that every rank reads or gathers only what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.models.builder import unwrap
from megatron_dapo.models.families import (
    ModelArch,
    ParamMapping,
    expert_name_shift,
    experts_per_rank,
    from_te_name,
    param_mappings,
    tied_output_source,
)
from megatron_dapo.models.lora import base_param_name, is_adapter_param
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.layout import local_to_global_name, pp_layer_range, tp_merge, tp_shard


@dataclass(frozen=True)
class LocalParam:
    chunk: int  # virtual-pipeline chunk index on this rank
    local_name: str  # name inside the chunk's GPTModel state dict
    mapping: ParamMapping  # global name + HF names + layout kind
    param: torch.Tensor


def chunk_layer_offset(arch: ModelArch, pp_size: int, pp_rank: int, vpp_size: Optional[int], vpp_rank: int) -> int:
    return pp_layer_range(arch.num_layers, pp_size, pp_rank, vpp_size, vpp_rank).start


def expert_offset(arch: ModelArch) -> int:
    """Global id of this rank's first local expert (``ep_rank × E/EP``; 0 for a dense model)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    if not arch.is_moe:
        return 0
    ep_size = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * experts_per_rank(arch, ep_size)


def shard_group(mapping: ParamMapping) -> tuple[int, int]:
    """(size, rank) of the group ``mapping.tp_dim`` is split over: expert TP (ETP) for expert weights, else TP."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    if mapping.is_expert:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def global_named_parameters(chunks: list, arch: ModelArch) -> Iterator[tuple[int, str, str, torch.Tensor]]:
    """(chunk index, local name, global name, parameter) of every parameter of this rank's chunks, LoRA adapters
    included: the local name is the chunk's own (a wrapped base weight unwrapped: ``base_param_name``), the global
    one has the global layer index and, for experts, the global expert index (``ep_rank × E/EP + j``)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    e_offset = expert_offset(arch)
    for ci, chunk in enumerate(chunks):
        offset = chunk_layer_offset(arch, pp_size, pp_rank, vpp, ci)
        for wrapped_name, param in unwrap(chunk).named_parameters():
            local_name = base_param_name(wrapped_name)
            global_name = expert_name_shift(local_to_global_name(from_te_name(local_name), offset), e_offset)
            yield ci, local_name, global_name, param


def local_param_table(chunks: list, arch: ModelArch) -> list[LocalParam]:
    """Every base parameter of this rank's chunks with its global mapping (tied output weights included). Expert
    weights are this EP rank's experts only (local index j = global expert ``ep_rank × E/EP + j``). On a model with
    LoRA adapters (models/lora.py) the base weights keep their unwrapped names and the adapters are left out."""
    by_name = {m.mcore: m for m in param_mappings(arch)}
    table = []
    for ci, local_name, global_name, param in global_named_parameters(chunks, arch):
        if is_adapter_param(local_name):
            continue
        mapping = by_name.get(global_name) or by_name.get(tied_output_source(arch, global_name) or "")
        if mapping is None:
            raise KeyError(
                f"parameter {local_name!r} (global {global_name!r}) has no HF mapping for {arch.family.name}"
            )
        table.append(LocalParam(ci, local_name, mapping, param))
    return table


@torch.no_grad()
def load_full_tensors(
    chunks: list, arch: ModelArch, get_full: Callable[[ParamMapping], torch.Tensor], where: str = "load"
) -> None:
    """Fill this rank's parameters: ``get_full(mapping)`` returns the full Megatron tensor; we keep our TP slice.
    ``where`` (the source) starts the error when a shape does not fit."""
    for lp in local_param_table(chunks, arch):
        tp_size, tp_rank = shard_group(lp.mapping)
        full = get_full(lp.mapping)
        shard = tp_shard(full, lp.mapping.kind, lp.mapping.tp_dim, tp_size, tp_rank, lp.mapping.sections)
        if tuple(shard.shape) != tuple(lp.param.shape):
            raise CheckpointError(
                f"{where}: {lp.mapping.hf} give shard shape {tuple(shard.shape)} (full {tuple(full.shape)}) for "
                f"{lp.mapping.mcore}, expected {tuple(lp.param.shape)}"
            )
        lp.param.copy_(shard)


@torch.no_grad()
def gather_full_tensor(lp: LocalParam) -> torch.Tensor:
    """All-gather ``lp``'s TP shards into the full Megatron tensor (collective over the TP group; the expert TP
    group for expert weights)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    tp_size, _ = shard_group(lp.mapping)
    local = lp.param.detach()
    if lp.mapping.tp_dim is None or tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    group = ps.get_expert_tensor_parallel_group() if lp.mapping.is_expert else ps.get_tensor_model_parallel_group()
    dist.all_gather(shards, local.contiguous(), group=group)
    return tp_merge(shards, lp.mapping.kind, lp.mapping.tp_dim, lp.mapping.sections)


def unique_local_params(chunks: list, arch: ModelArch) -> list[LocalParam]:
    """``local_param_table`` with each global tensor once: the tied output-layer copy (``tied_output_source``) maps
    to the embedding and is dropped."""
    seen, out = set(), []
    for lp in local_param_table(chunks, arch):
        if lp.mapping.mcore not in seen:
            seen.add(lp.mapping.mcore)
            out.append(lp)
    return out


def iter_full_tensors(chunks: list, arch: ModelArch) -> Iterator[tuple[ParamMapping, torch.Tensor]]:
    """This pipeline stage's full tensors (TP-gathered), skipping the tied output copy. Collective over TP (and over
    ETP for expert weights). With EP > 1 only this EP rank's experts are yielded (no gather over EP)."""
    for lp in unique_local_params(chunks, arch):
        yield lp.mapping, gather_full_tensor(lp)
